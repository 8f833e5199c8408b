"""`SamplingParams`: how a request's tokens are chosen. Part of the wire contract: the ingresses
build it, the router reads `max_new_tokens`, the engine's sampler applies it. Pydantic only, no
torch (architecture §3)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """Per-request sampling knobs (validated; bad values raise `pydantic.ValidationError`, a
    `ValueError`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(default=128, ge=1, description="tokens to generate at most")
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 (or 0) disables")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop_token_ids: tuple[int, ...] = Field(default=(), description="finish when one is sampled")
    ignore_eos: bool = False

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or a positive int")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
