"""A chunked-attention model (Llama 4) served by the cluster: workers report their chunk, the
router's exact view predicts a session's hit by the chunk rule, and turn 2 lands on turn 1's
worker and reuses all of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import ray
from cluster_harness import ServedCluster, greedy, stream, wait_idle, wait_idle_for_reuse

from swaserve.proto.swaserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.slow

C = 8


def test_a_session_on_a_chunked_model_reuses_its_history_where_the_router_predicts(
    make_cluster: Callable[..., ServedCluster], tiny_model_factory: Callable[..., Path]
) -> None:
    model = tiny_model_factory("llama4", num_layers=4, sliding_window_size=C, seed=2)
    served = make_cluster(model=model, replicas=2)
    stub = served.stub()
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.attention_chunk_size, info.sliding_window_size) == (C, C - 1)
    tokenizer = served.cluster.tokenizer
    assert tokenizer is not None
    turn1 = tokenizer.encode("System: you are a terse assistant.\nUser: chunked attention?\n")
    answer, _, first = stream(
        stub, pb.GenerateRequest(token_ids=turn1, session_id="c-1", sampling_params=greedy(20))
    )
    assert first.cached_tokens == 0
    wait_idle_for_reuse(served)
    turn2 = turn1 + answer + tokenizer.encode("\nUser: and the radix cache?\n")[1:]
    history = len(turn1) + len(answer) - 1  # the last answer token was never computed
    hits = ray.get(served.cluster.router.predict_hits.remote(turn2[:-1]), timeout=10)
    assert hits[first.worker_id] == history
    assert sum(hits.values()) == history  # the other worker holds nothing
    _, _, second = stream(
        stub, pb.GenerateRequest(token_ids=turn2, session_id="c-1", sampling_params=greedy(8))
    )
    assert second.worker_id == first.worker_id
    assert second.cached_tokens == history
    wait_idle(served)
    ray.get(served.cluster.router.check.remote(), timeout=10)
