"""The hybrid-SWA engine of one worker (one TP group). `EngineConfig` and `SamplingParams`
import without torch; the engine itself is imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swaserve.proto.sampling_params import SamplingParams
from swaserve.worker.config import EngineConfig
from swaserve.worker.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from swaserve.worker.engine.engine import Engine, GenerateOutput, RequestError, RequestOutput

_EXPORTS = {
    "Engine": "swaserve.worker.engine.engine",
    "GenerateOutput": "swaserve.worker.engine.engine",
    "RequestError": "swaserve.worker.engine.engine",
    "RequestOutput": "swaserve.worker.engine.engine",
}
__all__ = [
    "Engine",
    "EngineConfig",
    "GenerateOutput",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
__getattr__ = lazy_getattr("swaserve.worker", _EXPORTS)
