"""`EngineRequest`: one request as it crosses from an ingress to the worker the router chose."""

from __future__ import annotations

from dataclasses import dataclass

from swaserve.proto.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """The prompt's token ids (a migrated request's include the tokens streamed so far) and
    how to sample the rest. `request_id` is unique among the requests open on a worker.
    `resumed_tokens`: how many of the last prompt tokens the request generated already (a
    migrated request's): its grammar, penalties and `min_tokens` count them as output."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    resumed_tokens: int = 0
