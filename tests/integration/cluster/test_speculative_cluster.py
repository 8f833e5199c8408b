"""Speculative decoding on the served cluster: gRPC streams from workers that verify n-gram
(or MTP) drafts give exactly the tokens of plain decoding in-process (a stream item may now carry several
tokens), a request can turn its drafts off, and the workers' reports count drafts and accepted
tokens for the metrics."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cluster_harness import ServedCluster, greedy, reference_tokens, stream, wait_idle

from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.proto.text.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow


def test_streams_with_drafts_equal_plain_decoding(
    make_cluster: Callable[..., ServedCluster], cluster_model: Path
) -> None:
    served = make_cluster(replicas=2, speculative_method="ngram", num_speculative_tokens=4)
    phrases = [[11, 12, 13], [40, 41, 42, 43], [7, 7, 8], [90, 91, 92, 93, 94]]
    prompts = [phrases[i % 4] * (3 + i % 5) + [60 + i] for i in range(12)]
    expected = reference_tokens(cluster_model, prompts, [24] * len(prompts))
    tokenizer = TextTokenizer(cluster_model)
    with served.channel() as channel:
        stub = pb_grpc.InferenceStub(channel)

        def one(i: int) -> tuple[list[int], str, pb.GenerateResponse, int]:
            spec = {"num_speculative_tokens": 0} if i == 0 else {}  # request 0: no drafts
            request = pb.GenerateRequest(
                request_id=f"s{i}", token_ids=prompts[i], sampling_params=greedy(24, **spec)
            )
            items = list(stub.Generate(request, timeout=60))
            ids = [t for item in items for t in item.token_ids]
            return ids, "".join(item.text for item in items), items[-1], len(items)

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, range(len(prompts))))
    multi = 0
    for i, (ids, text, last, items) in enumerate(results):
        assert ids == expected[i], f"request {i}"
        assert text == tokenizer.decode(ids)
        assert last.usage.completion_tokens == len(ids) == 24
        multi += items < len(ids)  # some stream items carried several tokens
    assert multi > 0
    wait_idle(served)
    reports = [status.headroom for status in served.loop.run(served.cluster.load())]
    assert sum(h.spec_accepted_tokens_total for h in reports) > 0
    assert {h.spec_method for h in reports} == {"ngram"}
    assert sum(h.spec_draft_tokens_total for h in reports) >= sum(
        h.spec_verifies_total for h in reports
    )
    ids, _, _ = stream(
        served.stub(),
        pb.GenerateRequest(token_ids=prompts[1], sampling_params=greedy(24)),
    )
    assert ids == expected[1]


def test_streams_with_mtp_drafts_equal_plain_decoding(
    make_cluster: Callable[..., ServedCluster], tiny_model_factory: Callable[..., Path]
) -> None:
    """Workers that draft with MiMo-V2-Flash's MTP depths (`--speculative-method mtp`, the
    engine config the cluster hands its workers): concurrent gRPC streams give plain
    decoding's tokens, and the reports count the drafts verified."""
    model = tiny_model_factory("mimo-v2-flash", num_layers=4, sliding_window_size=8, seed=4)
    served = make_cluster(model=model, replicas=2, speculative_method="mtp")
    prompts = [[(7 * i + j) % 200 + 1 for j in range(10 + 3 * i)] for i in range(8)]
    expected = reference_tokens(model, prompts, [20] * len(prompts))
    with served.channel() as channel:
        stub = pb_grpc.InferenceStub(channel)

        def one(i: int) -> list[int]:
            request = pb.GenerateRequest(
                request_id=f"m{i}", token_ids=prompts[i], sampling_params=greedy(20)
            )
            return [t for item in stub.Generate(request, timeout=60) for t in item.token_ids]

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(one, range(len(prompts)))) == expected
    wait_idle(served)
    reports = [status.headroom for status in served.loop.run(served.cluster.load())]
    assert sum(h.spec_draft_tokens_total for h in reports) > 0
    assert {h.spec_method for h in reports} == {"mtp"}  # the metrics' `method` label
