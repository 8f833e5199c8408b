"""`EngineRequest`: one request as it crosses from an ingress to the worker the router chose."""

from __future__ import annotations

from dataclasses import dataclass

from swaserve.proto.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """The prompt's token ids (a migrated request's include the tokens streamed so far) and
    how to sample the rest. `request_id` is unique among the requests open on a worker."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
