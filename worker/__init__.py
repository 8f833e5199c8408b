"""The hybrid-SWA engine of one worker (one TP group)."""

from swaserve.worker.config import EngineConfig
from swaserve.worker.engine import Engine, GenerateOutput, RequestError, RequestOutput
from swaserve.worker.sampling import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "GenerateOutput",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
