"""Sampling parameters and the batched sampler.

Greedy when `temperature == 0`; otherwise temperature, then top-k, top-p and min-p filters, then a
draw. A request with a `seed` draws from its own generator, so its tokens do not depend on which
other requests share its batches.
"""

from __future__ import annotations

import torch
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


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A request's own generator when it asked for a seed, else None (the engine's is used)."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


class Sampler:
    """Turns a batch of logits into one token per row."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,  # [B, V] any float dtype
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:  # [B] int64
        if logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError("one SamplingParams and one generator slot per logits row")
        logits = logits.float()
        out = torch.argmax(logits, dim=-1)  # [B] int64
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return out
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = filtered_probs(logits[rows], [params[i] for i in sampled_rows])  # [b, V] float32
        for j, i in enumerate(sampled_rows):
            gen = generators[i] or self.generator
            out[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return out


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (rows renormalized)."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(
        1
    )  # [b, 1] float32
    logits = logits / temps
    vocab = logits.shape[-1]
    top_ks = torch.tensor(
        [p.top_k if p.top_k > 0 else vocab for p in params], device=device
    )  # [b] int64
    top_ks = top_ks.clamp(max=vocab)
    top_ps = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)  # [b, 1] float32
    min_ps = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)  # [b, 1] float32

    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [b, V]
    ranks = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V] int64
    drop = ranks >= top_ks.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop |= mass_before >= top_ps
    # min-p: drop tokens below min_p × the top probability.
    drop |= sorted_probs < min_ps * sorted_probs[:, :1]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.empty_like(sorted_probs)
    probs.scatter_(1, order, sorted_probs)
    return probs
