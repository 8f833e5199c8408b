"""ModelInfo: the served model as the ingresses describe it and check requests against.

    rank 0's engine  ─model_info_of_engine─►  WorkerInfo.model  ─model_info_of (driver: the
    served name, the ingress's tokenizer)─►  RoutedCluster.model_info
      ─public_fields─►  gRPC GetModelInfo, the OpenAI model card (`max_model_len`)
      ─limits.check─►   RoutedCluster.check_request, the OpenAI API's max_tokens

Every worker of a cluster runs the same engine config, so the first one's info stands for all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swaserve.proto.request_limits import RequestLimits
from swaserve.proto.text.tokenizer import tokenizer_dir

if TYPE_CHECKING:
    from swaserve.worker import Engine, EngineConfig


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model: its names, what clients are told (`public_fields`) and the limits
    every request must fit (`limits`)."""

    model_name: str
    model_path: str
    architecture: str
    vocab_size: int
    tp_size: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool
    limits: RequestLimits  # max_model_len, page size, W, the pools: what a request must fit

    def public_fields(self) -> dict[str, Any]:
        """What clients are told, named as in `swaserve.v1.ModelInfo` (whose `num_workers` is
        the cluster's to add)."""
        return {
            "model_name": self.model_name,
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "max_model_len": self.limits.max_model_len,
            "sliding_window_size": self.limits.sliding_window_size,
            "attention_chunk_size": self.limits.attention_chunk_size or 0,
            "page_size": self.limits.page_size,
            "tp_size": self.tp_size,
            "eos_token_ids": list(self.eos_token_ids),
            "has_tokenizer": self.has_tokenizer,
        }


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What rank 0 tells the driver once its engine is up (plain data for the ingress)."""

    worker_id: str
    device: str
    node_id: str
    model: ModelInfo  # the model its engine serves and the limits of a request


def model_info_of_engine(engine: Engine) -> ModelInfo:
    """A worker's engine, described (named after its model dir, with its own tokenizer)."""
    mc = engine.model_config
    return ModelInfo(
        model_name=Path(engine.config.model).name,
        model_path=engine.config.model,
        architecture=mc.architecture,
        vocab_size=mc.vocab_size,
        tp_size=engine.config.tp_size,
        eos_token_ids=tuple(sorted(mc.eos_token_ids)),
        has_tokenizer=engine.tokenizer is not None,
        limits=engine.request_limits,
    )


def model_info_of(
    engine: EngineConfig, info: WorkerInfo, served_model_name: str | None
) -> ModelInfo:
    """What the ingresses serve, from a worker's report: its model under the served name, with
    `has_tokenizer` as the ingress (which tokenizes) sees it."""
    return replace(
        info.model,
        model_name=served_model_name or Path(engine.model).name,
        has_tokenizer=(tokenizer_dir(engine.model, engine.tokenizer) / "tokenizer.json").is_file(),
    )
