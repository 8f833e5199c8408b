"""bench/node_chaos.py end to end at tiny sizes, in a subprocess with its own multi-node Ray
(Ray's test cluster utilities: one raylet per node): a worker's node and then the router's node
are removed while streams run over gRPC and HTTP; no stream is lost or differs, no request
reaches the dead worker once its loss is known, the replica comes back on a node that joins,
the router is restarted, and nothing is left running. No timing asserts."""

from __future__ import annotations

import pytest
from bench_subprocess import run_bench_script


@pytest.mark.slow
def test_a_node_that_dies_loses_no_stream() -> None:
    data = run_bench_script("node_chaos", ["--streams=6", "--max-new-tokens=64"])
    for fault in ("worker_node", "router_node"):
        result = data[fault]
        assert result["lost"] == 0, result
        assert result["differ"] == 0, result
        assert result["recovery_s"] is not None, result
    worker = data["worker_node"]
    assert worker["migrations"] >= 1  # the node held streams when it died
    assert worker["probes_on_dead"] == 0
    assert data["recreated_groups"] == 1  # on the node that joined after the loss
    router = data["router_node"]
    assert router["router_moved"]  # Ray restarted it on the other router node
    assert router["probes_cached"] == 4  # its view rebuilt from the workers' snapshots
    assert not worker["router_moved"]
    assert data["left_running"] == {"actors": 0, "placement_groups": 0}
