"""A whole node dies under load: on a multi-node Ray made on this machine (Ray's own test
cluster utilities: a head and one raylet per node), streams lose nothing.

Nodes: the head (the ingress: this process), two worker nodes of one CPU each (one replica
each: no spare room), two router nodes (a custom resource only the router actor asks for,
`ClusterConfig.router_resources`). N concurrent greedy `ignore_eos` streams (half gRPC, half
the OpenAI HTTP API, as `chaos.py`) run three times:

1. undisturbed: the reference tokens;
2. a worker's node removed (its raylet and every process on it) once a random 10-60% of the
   tokens were streamed: its streams migrate; the cluster drops the worker from the router at
   once (probe requests sent right after its loss is known must all land elsewhere); a new
   node then joins and the replica is recreated there (capacity back);
3. the router's node removed: Ray restarts the router on the other router node, which rebuilds
   its view from the workers' snapshots.

Per fault: streams lost (goal 0), streams differing from the undisturbed run (goal 0),
migrations, seconds until the loss was known, seconds until 2 workers serve again, probe
requests that reached a dead worker (goal 0). At the end: Ray actors and placement groups of
the cluster left alive (goal 0).

    python bench/node_chaos.py [--json] [--streams 8] [--max-new-tokens 96] [--seed 0]
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep 127.0.0.1 (before ray)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse
import asyncio
import contextlib
import json
import random
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from chaos import (
    Streams,
    cluster_config,
    fault_result,
    parse_stream_args,
    print_fault,
    prompts_of,
    run,
    serving,
)
from multiturn import make_model
from ray._private import ray_constants
from ray.cluster_utils import Cluster as RayTestCluster
from ray.util.placement_group import placement_group_table

from swaserve.cluster.cluster import Cluster
from swaserve.proto.swaserve.v1 import inference_pb2 as pb

ROUTER_RESOURCE = "swaserve_router_node"
LOOPBACK = "127.0.0.1"
PROBES = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_stream_args(argv, __doc__, streams=8, max_new_tokens=96, hidden=64, layers=2)


class Nodes:
    """The multi-node Ray: `add_worker_node()` / `add_router_node()` / `remove(node_id)`."""

    def __init__(self) -> None:
        self.ray = RayTestCluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": False},
        )
        self.nodes: dict[str, Any] = {}  # node id -> the test cluster's node

    def add(self, **resources: Any) -> str:
        node = self.ray.add_node(node_ip_address=LOOPBACK, **resources)
        self.ray.wait_for_nodes()
        self.nodes[node.node_id] = node
        return str(node.node_id)

    def add_worker_node(self) -> str:
        return self.add(num_cpus=1)

    def add_router_node(self) -> str:
        return self.add(num_cpus=0, resources={ROUTER_RESOURCE: 1})

    def remove(self, node_id: str) -> None:
        """The node dies at once, as a machine does: its raylet's processes and every process
        the raylet started (the actors on it) are SIGKILLed together. Ray's `remove_node`
        alone kills the raylet only; its workers would stream on for a moment."""
        node = self.nodes.pop(node_id)
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        workers = descendants(raylet)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.ray.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        self.ray.shutdown()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@contextlib.contextmanager
def multi_node_ray() -> Iterator[Nodes]:
    nodes = Nodes()
    try:
        for _ in range(2):
            nodes.add_worker_node()
            nodes.add_router_node()
        ray.init(address=nodes.ray.address, log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def node_of_worker(cluster: Cluster, worker_id: str) -> str:
    table = placement_group_table(cluster.groups[worker_id].placement_group)
    return str(table["bundles_to_node_id"][0])


def node_of_router() -> str:
    from ray._private import state

    for actor in state.actors().values():
        if actor["ActorClassName"] == "RouterActor" and actor["State"] == "ALIVE":
            return str(actor["Address"]["NodeID"])
    raise RuntimeError("no live router actor")


def left_running(cluster_pgs: set[str]) -> dict[str, int]:
    """The cluster's actors still alive and its placement groups not removed."""
    from ray._private import state

    actors = [a for a in state.actors().values() if a["State"] != "DEAD"]
    groups = placement_group_table()
    pgs = [g for g, info in groups.items() if g in cluster_pgs and info["state"] != "REMOVED"]
    return {"actors": len(actors), "placement_groups": len(pgs)}


async def probes_on(streams: Streams, dead: set[str]) -> int:
    """Send `PROBES` short requests; how many were served by a worker in `dead`."""
    on_dead = 0
    for i in range(PROBES):
        request = pb.GenerateRequest(
            token_ids=[7, 8, 9, i], sampling_params=pb.SamplingParams(max_new_tokens=2)
        )
        async for item in streams.stub.Generate(request, timeout=120):
            if item.worker_id in dead:
                on_dead += 1
                break
    return on_dead


async def probes_cached(streams: Streams, prompts: list[list[int]]) -> int:
    """Send earlier streams' prompts again: how many found most of their prompt cached (the
    router sent them to the worker holding it)."""
    hits = 0
    for prompt in prompts:
        request = pb.GenerateRequest(
            token_ids=prompt, sampling_params=pb.SamplingParams(max_new_tokens=1)
        )
        cached = 0
        async for item in streams.stub.Generate(request, timeout=120):
            cached = max(cached, item.cached_tokens)
        hits += cached >= len(prompt) // 2
    return hits


async def main_async(args: argparse.Namespace, model_dir: str, nodes: Nodes) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = cluster_config(model_dir, router_resources={ROUTER_RESOURCE: 0.01})
    prompts = prompts_of(args, rng)
    pgs: set[str] = set()
    out: dict[str, Any] = {}
    async with serving(config, prompts, args.max_new_tokens) as (cluster, streams, base):
        out["undisturbed_wall_s"] = round(base["wall_s"], 2)
        seen: dict[str, Any] = {}

        async def kill_worker_node() -> Callable[[], bool]:
            # the worker streaming most (the router may have put every stream on one)
            victim = max(sorted(cluster.live_workers), key=cluster.open_on)
            node = node_of_worker(cluster, victim)
            seen.update(victim=victim, killed=time.monotonic())
            nodes.remove(node)

            async def after_loss() -> None:  # probes, then the node that rejoins
                while victim not in cluster.lost:
                    await asyncio.sleep(0.01)
                seen["loss_known_s"] = time.monotonic() - seen["killed"]
                seen["probes_on_dead"] = await probes_on(streams, set(cluster.lost))
                nodes.add_worker_node()

            seen["task"] = asyncio.create_task(after_loss())
            return lambda: "loss_known_s" in seen

        async def kill_router_node() -> Callable[[], bool]:
            node = node_of_router()
            seen.clear()
            seen.update(killed=time.monotonic())
            nodes.remove(node)

            def restarted() -> bool:  # alive again, on a node that lives
                try:
                    return node_of_router() != node
                except RuntimeError:  # dead, not restarted yet
                    return False

            return restarted

        for name, kill in (("worker_node", kill_worker_node), ("router_node", kill_router_node)):
            pgs.update(group.placement_group.id.hex() for group in cluster.groups.values())
            migrations, router_node = cluster.migrations, node_of_router()
            share = rng.uniform(0.1, 0.6)
            fault = await run(streams, args.streams, kill, share)
            if "task" in seen:
                await seen.pop("task")
            if name == "router_node":  # the restarted router routes by the caches again
                seen["probes_cached"] = await probes_cached(streams, prompts[:PROBES])
            out[name] = fault_result(base, fault, cluster.migrations - migrations, share)
            out[name]["router_moved"] = node_of_router() != router_node  # restarted
            for key in ("loss_known_s", "probes_on_dead", "probes_cached"):
                if key in seen:
                    out[name][key] = seen[key]
        out["recreated_groups"] = cluster.recreated
    pgs.update(group.placement_group.id.hex() for group in cluster.groups.values())
    out["left_running"] = left_running(pgs)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, multi_node_ray() as nodes:
        model_dir = str(make_model(tmp, args))
        out = asyncio.run(main_async(args, model_dir, nodes))
    load = os.getloadavg()[0]
    print(
        f"node chaos: {args.streams} greedy streams × {args.max_new_tokens} tokens (gRPC + HTTP), "
        f"2 replicas on 2 one-CPU nodes, router on 2 router nodes; undisturbed run "
        f"{out['undisturbed_wall_s']} s; load {load:.1f}"
    )
    for name in ("worker_node", "router_node"):
        r = out[name]
        extra = f", router on another node {r['router_moved']}"
        if "loss_known_s" in r:
            extra += f", loss known after {r['loss_known_s']:.2f} s, probes on the dead worker "
            extra += f"{r['probes_on_dead']}/{PROBES}"
        if "probes_cached" in r:
            extra += f", earlier prompts found cached {r['probes_cached']}/{PROBES}"
        print_fault(name, r, "removed", extra)
    print(f"  left running after shutdown: {out['left_running']} (goal 0, 0)")
    if args.json:
        print(json.dumps({**out, "load": load}, default=str))


if __name__ == "__main__":
    main()
