"""`EngineConfig`: every knob of one worker's engine, validated at construction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swaserve.worker.kv.pool_plan import (
    DEFAULT_SWA_EVICTION_INTERVAL,
    DEFAULT_SWA_FULL_TOKENS_RATIO,
)

if TYPE_CHECKING:
    from swaserve.worker.kv.memory import KVMemoryConfig

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20
"""KV budget on CPU when neither `kv_cache_bytes` nor `max_total_tokens` is given."""


class EngineConfig(BaseModel):
    """Configuration of one engine (one TP group). Field names of architecture §5 are fixed.

    KV size: give `kv_cache_bytes` or `max_total_tokens` (full-pool tokens), or neither: then
    CUDA takes `mem_fraction_static` of the free memory after the weights, CPU 256 MiB.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="path of an HF-format model directory")
    tokenizer: str | None = Field(default=None, description="tokenizer dir; defaults to `model`")
    device: str = Field(default="auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = Field(default=0, ge=0)

    page_size: int = Field(default=1, ge=1, le=1024)
    max_total_tokens: int | None = Field(default=None, gt=0)
    kv_cache_bytes: int | None = Field(default=None, gt=0)
    mem_fraction_static: float = Field(default=0.85, gt=0.0, lt=1.0)
    swa_full_tokens_ratio: float | Literal["auto"] = Field(
        default=DEFAULT_SWA_FULL_TOKENS_RATIO,
        description="SWA-pool tokens per full-pool token, in (0, 1], or 'auto' (needs expected_seq_len)",
        json_schema_extra={
            "exclusiveMinimum": 0,
            "maximum": 1,
        },  # of a number: the validator's range
    )
    expected_seq_len: int | None = Field(default=None, gt=0, description="for the auto ratio")
    disable_hybrid_swa_memory: bool = False
    enable_prefix_cache: bool = True
    enable_window_repair: bool = Field(
        default=True,
        description="resume a cached prefix whose SWA window was freed by recomputing only its "
        "receptive field (L_swa x W tokens) instead of the whole prompt",
    )
    window_checkpoint_slack_tokens: int = Field(
        default=8,
        ge=0,
        description="tokens a window checkpoint keeps beyond W + one page before a prompt's end: "
        "a chat template that renders a finished turn without its generation prompt's last "
        "tokens (MiMo's <think></think>) resumes there without a window repair",
    )
    swa_eviction_interval: int = Field(default=DEFAULT_SWA_EVICTION_INTERVAL, ge=1)

    chunked_prefill_size: int | None = Field(
        default=2048, gt=0, description="None disables chunking"
    )
    max_prefill_tokens: int = Field(default=16384, gt=0, description="new prompt tokens per step")
    max_running_requests: int = Field(default=256, gt=0)
    stream_interval_ms: float = Field(
        default=50.0,
        ge=0,
        le=1000,
        description="a served request's tokens after its first leave its worker at most this "
        "often, those of the steps in between in one message (its first token and its end "
        "go at once): fewer messages through Ray and the ingress per token, as Ray Serve "
        "LLM's stream_batching_interval_ms (50 ms); 0: each step's tokens at once",
    )
    max_model_len: int | None = Field(default=None, gt=0, description="defaults to the model's")
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    schedule_conservativeness: float = Field(
        default=1.0,
        gt=0.0,
        le=10.0,
        description="how much of max_new_tokens admission reserves; < 1 admits more",
    )
    attention_backend: Literal["auto", "torch", "flash"] = "auto"
    dequantize_weights: bool = Field(
        default=False,
        description="dequantize a quantized checkpoint (MXFP4 experts, FP8 block weights) to "
        "dtype at load; by default it stays quantized in memory and only the weights a step "
        "runs are dequantized (FP8 linears use _scaled_mm on GPUs that have it)",
    )
    compile: bool | Literal["auto"] = Field(
        default="auto",
        description="run pure-decode steps as one fixed-shape graph per batch bucket: CUDA "
        "graphs on CUDA, torch.compile (inductor, cached on disk) on CPU, made before the "
        "first request; 'auto': CUDA graphs on CUDA, and on CPU (TP 1) eager steps until a "
        "background thread has compiled each bucket (see the README)",
    )
    speculative_method: Literal["ngram", "mtp"] | None = Field(
        default=None,
        description="draft tokens and verify them in one forward (exact: greedy output is "
        "token-for-token the output without it): 'ngram' proposes what followed the latest "
        "earlier occurrence of the sequence's own suffix (prompt and output); 'mtp' runs the "
        "checkpoint's multi-token-prediction layers (MiMo-V2-Flash); None: off",
    )
    num_speculative_tokens: int = Field(
        default=3, ge=1, le=16, description="k: draft tokens per request and step"
    )
    speculative_disable_by_batch_size: int | None = Field(
        default=None,
        gt=0,
        description="no drafts in a step where at least this many requests decode (a large "
        "batch is compute-bound: verifying k drafts each costs more than it saves); None: "
        "drafts at every batch size",
    )
    speculative_ngram_min: int = Field(
        default=2, ge=1, le=64, description="ngram: shortest suffix that may propose drafts"
    )
    speculative_ngram_max: int = Field(
        default=5, ge=1, le=64, description="ngram: longest suffix looked up (longest wins)"
    )
    tp_size: int = Field(default=1, ge=1, description="tensor-parallel ranks (one per device)")
    tp_timeout_s: float = Field(
        default=60.0, gt=0, description="how long a TP collective may wait for a rank"
    )
    check_on_idle: bool = Field(
        default=True,
        description=(
            "when a step finds nothing to run, check the allocator, the prefix cache and the "
            "slot table (Engine.check: O(pool slots + cached tokens), about 1 ms per 10^5 slots "
            "on CPU); never runs while requests are running"
        ),
    )

    @model_validator(mode="after")
    def _combinations(self) -> EngineConfig:
        if self.kv_cache_bytes is not None and self.max_total_tokens is not None:
            raise ValueError("give kv_cache_bytes or max_total_tokens, not both")
        ratio = self.swa_full_tokens_ratio
        if ratio == "auto":
            if self.expected_seq_len is None:
                raise ValueError(
                    'swa_full_tokens_ratio="auto" needs expected_seq_len (mean tokens per request)'
                )
            if self.max_total_tokens is not None:
                raise ValueError(
                    'swa_full_tokens_ratio="auto" sizes pools from bytes; use kv_cache_bytes'
                )
        elif not 0.0 < ratio <= 1.0:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1] or 'auto', got {ratio}")
        if self.max_total_tokens is not None and self.max_total_tokens % self.page_size:
            raise ValueError(
                f"max_total_tokens={self.max_total_tokens} is not a multiple of page_size={self.page_size}"
            )
        if self.chunked_prefill_size is not None:
            if self.chunked_prefill_size % self.page_size:
                raise ValueError(
                    f"chunked_prefill_size={self.chunked_prefill_size} is not a multiple of page_size={self.page_size}"
                )
            if self.chunked_prefill_size > self.max_prefill_tokens:
                raise ValueError(
                    f"chunked_prefill_size={self.chunked_prefill_size} exceeds max_prefill_tokens={self.max_prefill_tokens}"
                )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min={self.speculative_ngram_min} exceeds "
                f"speculative_ngram_max={self.speculative_ngram_max}"
            )
        if self.attention_backend == "flash" and self.device == "cpu":
            raise ValueError("attention_backend='flash' needs a CUDA device")
        return self

    def kv_memory_config(self, *, kv_cache_bytes: int | None = None) -> KVMemoryConfig:
        """The KV part, with the byte budget resolved by the engine when none was given."""
        from swaserve.worker.kv.memory import KVMemoryConfig

        budget = self.kv_cache_bytes if self.kv_cache_bytes is not None else kv_cache_bytes
        return KVMemoryConfig(
            page_size=self.page_size,
            kv_cache_bytes=None if self.max_total_tokens is not None else budget,
            max_total_tokens=self.max_total_tokens,
            swa_full_tokens_ratio=self.swa_full_tokens_ratio,
            expected_seq_len=self.expected_seq_len,
            disable_hybrid_swa_memory=self.disable_hybrid_swa_memory,
            enable_prefix_cache=self.enable_prefix_cache,
            chunked_prefill_size=self.chunked_prefill_size,
            max_running_requests=self.max_running_requests,
            swa_eviction_interval=self.swa_eviction_interval,
            draft_tokens=self.num_speculative_tokens if self.speculative_method else 0,
        )
