"""One replica of TP 2 on Ray: rank 0 and rank 1 are actors of one STRICT_PACK placement group,
and the cluster's tokens equal those of one in-process engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import ray
from cluster_harness import ServedCluster, run_concurrent_streams, wait_idle
from ray.util.placement_group import placement_group_table

pytestmark = pytest.mark.slow


def test_concurrent_streams_on_one_tp2_group_match_one_engine(
    make_cluster: Callable[..., ServedCluster], cluster_model: Path
) -> None:
    served = make_cluster(replicas=1, tp_size=2)
    group = served.cluster.groups["worker-0"]
    table = placement_group_table(group.placement_group)
    assert table["strategy"] == "STRICT_PACK"
    assert list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert len(group.rank_actors) == 1
    assert run_concurrent_streams(served, cluster_model) == {"worker-0"}
    load = wait_idle(served)
    assert load["worker-0"].tp_size == 2
    w = load["worker-0"]
    assert w.full_free_tokens + w.full_evictable_tokens == w.full_total_tokens
    assert w.swa_free_tokens + w.swa_evictable_tokens == w.swa_total_tokens
    assert ray.get(group.rank_actors[0].ping.remote(), timeout=10)
