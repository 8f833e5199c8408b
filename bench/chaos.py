"""Faults under load: streams that lose nothing when a worker process or the router dies.

On a local cluster (2 replicas × TP 1, a tiny GPT-OSS model, one local Ray), N concurrent
greedy `ignore_eos` streams — half over gRPC (`grpc.aio`), half over the OpenAI HTTP API
(the stock `openai` client, `/v1/completions` with token-id prompts and `return_token_ids`)
— run three times on the same cluster:

1. undisturbed: the reference tokens of every stream (the baseline, same process);
2. worker fault: at a random moment while the streams run (once a random 10-60% of all their
   tokens have been streamed), one worker's rank-0 process is SIGKILLed; its streams migrate (prompt + tokens so far, routed again), and `swaserve`
   recreates the group;
3. router fault: the same with the router actor's process SIGKILLed; Ray restarts it and
   it rebuilds its view from the workers' reports and cache snapshots.

Per fault: streams lost (ended in an error; goal 0), streams whose tokens differ from the
undisturbed run (goal 0), migrations, and the seconds from the kill until `GetLoad` lists 2
workers again (goal ≤ 60 s on a 2-core CPU).

    python bench/chaos.py [--json] [--streams 16] [--max-new-tokens 160] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import openai
from multiturn import local_ray, make_model

from swaserve.cluster.cluster import Cluster, ClusterConfig
from swaserve.cluster.grpc_server import GrpcServer, GrpcServerConfig
from swaserve.cluster.http_server import HttpServer
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.worker import EngineConfig

RECOVERY_GOAL_S = 60.0


def parse_stream_args(
    argv: list[str] | None,
    description: str | None,
    *,
    streams: int,
    max_new_tokens: int,
    hidden: int,
    layers: int,
) -> argparse.Namespace:
    """The fault benches' flags (this one's and `node_chaos.py`'s), with their defaults."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=streams, help="concurrent streams per run")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--window", type=int, default=32, help="W of the sliding layers")
    parser.add_argument("--seed", type=int, default=0, help="prompts, kill moments, victims")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.streams < 2 or args.max_new_tokens < 8 or args.prompt_tokens < 1:
        parser.error("need --streams >= 2, --max-new-tokens >= 8, --prompt-tokens >= 1")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_stream_args(argv, __doc__, streams=16, max_new_tokens=160, hidden=128, layers=4)


class Streams:
    """The run's clients: stream i goes over gRPC when i is even, else over HTTP."""

    def __init__(self, grpc_port: int, http_port: int, prompts: list[list[int]], n: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.http = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0
        )
        self.prompts = prompts
        self.max_new = n
        self.streamed = 0  # tokens received over all streams of the run
        self.kill_at = 0  # ... when `reached` is set
        self.reached = asyncio.Event()

    def got(self, n: int) -> None:
        self.streamed += n
        if self.kill_at and self.streamed >= self.kill_at:
            self.reached.set()

    async def one(self, i: int) -> tuple[list[int] | None, str]:
        """The stream's tokens (None if it ended in an error) and the error, if any."""
        try:
            if i % 2 == 0:
                return await self._grpc(i), ""
            return await self._http(i), ""
        except (grpc.aio.AioRpcError, openai.APIError) as exc:
            return None, f"{type(exc).__name__}: {exc}"[:300]

    async def _grpc(self, i: int) -> list[int]:
        request = pb.GenerateRequest(
            token_ids=self.prompts[i],
            sampling_params=pb.SamplingParams(
                max_new_tokens=self.max_new, temperature=0.0, ignore_eos=True
            ),
        )
        tokens: list[int] = []
        async for item in self.stub.Generate(request, timeout=300):
            tokens.extend(item.token_ids)
            self.got(len(item.token_ids))
        return tokens

    async def _http(self, i: int) -> list[int]:
        stream = await self.http.completions.create(
            model="chaos",
            prompt=self.prompts[i],
            max_tokens=self.max_new,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
            timeout=300,
        )
        tokens: list[int] = []
        async for chunk in stream:
            for choice in chunk.choices:
                new = (choice.model_extra or {}).get("token_ids") or []
                tokens.extend(new)
                self.got(len(new))
        return tokens

    async def workers(self) -> int:
        """Workers GetLoad lists; 0 while it fails (the router is coming back)."""
        try:
            load = await self.stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        except grpc.aio.AioRpcError:
            return 0
        return len(load.workers)

    async def close(self) -> None:
        await self.channel.close()
        await self.http.close()


async def wait_for_workers(streams: Streams, n: int, since: float) -> float:
    """Seconds from `since` until GetLoad lists `n` workers."""
    while await streams.workers() < n:
        await asyncio.sleep(0.1)
    return time.monotonic() - since


async def run(
    streams: Streams,
    n: int,
    kill: Callable[[], Awaitable[Callable[[], bool]]] | None,
    at_share: float,
) -> dict[str, Any]:
    """All streams at once; `kill` fires once `at_share` of all their tokens were streamed
    and returns a test of whether the cluster has seen the loss."""
    streams.streamed, streams.reached = 0, asyncio.Event()
    streams.kill_at = max(1, int(at_share * n * streams.max_new)) if kill is not None else 0
    started = time.monotonic()
    tasks = [asyncio.create_task(streams.one(i)) for i in range(n)]
    recovery: float | None = None
    if kill is not None:
        await streams.reached.wait()
        killed_at = time.monotonic()
        seen = await kill()
        while not seen() and time.monotonic() - killed_at < RECOVERY_GOAL_S:
            await asyncio.sleep(0.05)  # until the cluster saw the loss ...
        recovery = await wait_for_workers(streams, 2, killed_at)  # ... and healed
    results = await asyncio.gather(*tasks)
    return {
        "tokens": [tokens for tokens, _ in results],
        "errors": [error for _, error in results if error],
        "wall_s": time.monotonic() - started,
        "recovery_s": recovery,
    }


def compare(reference: list[list[int] | None], fault: dict[str, Any]) -> dict[str, Any]:
    got = fault["tokens"]
    lost = sum(t is None for t in got)
    differ = sum(t is not None and t != ref for t, ref in zip(got, reference, strict=True))
    return {"lost": lost, "differ": differ, "recovery_s": fault["recovery_s"]}


def fault_result(
    base: dict[str, Any], fault: dict[str, Any], migrations: int, share: float
) -> dict[str, Any]:
    """What a fault run lost against the undisturbed `base`, with its migrations."""
    return {
        **compare(base["tokens"], fault),
        "migrations": migrations,
        "kill_at_share": round(share, 2),
        "errors": fault["errors"][:3],
    }


@contextlib.asynccontextmanager
async def serving(
    config: ClusterConfig, prompts: list[list[int]], max_new_tokens: int
) -> AsyncIterator[tuple[Cluster, Streams, dict[str, Any]]]:
    """The cluster with both servers and the streams' clients, and the undisturbed run (the
    reference tokens); everything stopped after."""
    cluster = await Cluster.start(config)
    grpc_server = GrpcServer(cluster, GrpcServerConfig(port=0))
    http_server = HttpServer(cluster, port=0)
    try:
        grpc_port = await grpc_server.start()
        http_port = await http_server.start()
        streams = Streams(grpc_port, http_port, prompts, max_new_tokens)
        try:
            base = await run(streams, len(prompts), None, 0.0)
            if base["errors"]:
                raise RuntimeError(f"the undisturbed run failed: {base['errors'][:2]}")
            yield cluster, streams, base
        finally:
            await streams.close()
    finally:
        await http_server.stop()
        await grpc_server.stop(grace_s=1)
        await cluster.shutdown(timeout_s=10)


def print_fault(name: str, r: dict[str, Any], verb: str, extra: str = "") -> bool:
    """One fault's line (and its errors); whether it met its goals."""
    recovery = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f} s"
    ok = r["lost"] == 0 and r["differ"] == 0 and (r["recovery_s"] or 0) <= RECOVERY_GOAL_S
    print(
        f"  {name} {verb} at {r['kill_at_share']:.0%} of the tokens: lost {r['lost']}, differ "
        f"{r['differ']}, migrated {r['migrations']}{extra}, 2 workers again after {recovery} "
        f"(goal 0, 0, ≤ {RECOVERY_GOAL_S:.0f} s): {'met' if ok else 'MISSED'}"
    )
    for error in r["errors"]:
        print(f"    error: {error}")
    return ok


def prompts_of(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(250) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]


def cluster_config(model_dir: str, **more: Any) -> ClusterConfig:
    """The fault benches' cluster: 2 replicas of the model on CPU, fast reports."""
    return ClusterConfig(
        engine=EngineConfig(model=model_dir, device="cpu", max_total_tokens=16384),
        replicas=2,
        report_interval_s=0.05,
        served_model_name="chaos",
        **more,
    )


async def main_async(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = cluster_config(model_dir)
    async with serving(config, prompts_of(args, rng), args.max_new_tokens) as served:
        cluster, streams, base = served
        out: dict[str, Any] = {"undisturbed_wall_s": round(base["wall_s"], 2)}

        async def kill_worker() -> Callable[[], bool]:
            victim = rng.choice(sorted(cluster.live_workers))
            os.kill(await cluster.groups[victim].engine.pid.remote(), signal.SIGKILL)
            return lambda: victim in cluster.lost

        async def kill_router() -> Callable[[], bool]:
            os.kill(await cluster.router.pid.remote(), signal.SIGKILL)
            return lambda: True  # GetLoad fails until Ray has restarted it

        for name, kill in (("worker", kill_worker), ("router", kill_router)):
            migrations = cluster.migrations
            share = rng.uniform(0.1, 0.6)
            fault = await run(streams, args.streams, kill, share)
            out[name] = fault_result(base, fault, cluster.migrations - migrations, share)
        out["recreated_groups"] = cluster.recreated
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, local_ray():
        model_dir = str(make_model(tmp, args))
        out = asyncio.run(main_async(args, model_dir))
    load = os.getloadavg()[0]
    print(
        f"chaos: {args.streams} greedy streams × {args.max_new_tokens} tokens (gRPC + HTTP), "
        f"2 replicas; undisturbed run {out['undisturbed_wall_s']} s; load {load:.1f}"
    )
    for name in ("worker", "router"):
        print_fault(name, out[name], "killed")
    if args.json:
        print(json.dumps({**out, "load": load}))


if __name__ == "__main__":
    main()
