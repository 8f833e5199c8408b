"""The contract between swaserve's processes (architecture §3): the sampling parameters, the
request and stream records, the worker ↔ router messages and KV events, the public gRPC API, and
the text helpers (`proto.text`). Nothing here imports torch or the engine."""

from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.messages import Headroom, WorkerReport
from swaserve.proto.sampling_params import SamplingParams, StructuredOutputs
from swaserve.proto.stream import FinishReason, GenerateChunk, RequestTimings, TokenLogprob

__all__ = [
    "EngineRequest",
    "FinishReason",
    "GenerateChunk",
    "Headroom",
    "RequestTimings",
    "SamplingParams",
    "StructuredOutputs",
    "TokenLogprob",
    "WorkerReport",
]
