"""The hybrid-SWA engine of one worker (one TP group)."""

from swaserve.worker.config import EngineConfig
from swaserve.worker.engine.engine import Engine, GenerateOutput, RequestError, RequestOutput
from swaserve.worker.runner.sampler import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "GenerateOutput",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
