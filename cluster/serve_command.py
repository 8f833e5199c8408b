"""`swaserve serve`: start (or join) Ray, the router actor, the worker groups and the gRPC
ingress (and, with `--http-port`, the OpenAI-compatible HTTP API), then serve until SIGTERM /
Ctrl-C.

Without `--model` it serves a small random GPT-OSS-shaped demo model, made once in the cache
dir (`$SWASERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/swaserve`, else `~/.cache/swaserve`); its text
is gibberish, but every code path is the real one. On SIGTERM the health service turns
NOT_SERVING (HTTP `/health`: 503), new requests get UNAVAILABLE (HTTP 503), open streams get
`--drain-timeout-s` to finish, and every actor is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from swaserve.cluster.defaults import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT
from swaserve.cluster.ingress_limits import IngressLimits
from swaserve.cluster.knobs import (
    ENGINE_FLAGS,
    LIMIT_FLAGS,
    ROUTER_FLAGS,
    add_config_flags,
    config_overrides,
)
from swaserve.cluster.local_ray import (
    LOOPBACK,
    LocalRay,
    set_auth_mode,
    set_node_address,
)
from swaserve.proto import environment
from swaserve.proto.environment import API_KEY_ENV, AUTH_TOKEN_ENV, NODE_IP_ADDRESS_ENV, cache_dir
from swaserve.router import RouterConfig
from swaserve.worker import EngineConfig

if TYPE_CHECKING:
    from swaserve.cluster.cluster import Cluster, ClusterConfig
    from swaserve.cluster.grpc_server import GrpcServerConfig

logger = logging.getLogger("swaserve.serve")


DEMO_MODEL_NAME = "demo-gpt-oss"


def ensure_demo_model(root: Path | None = None) -> Path:
    """The demo model dir, made once (written to a temporary sibling, then renamed, so a
    crash never leaves half a model)."""
    from swaserve.worker.models.tiny import make_tiny_model

    target = (root or cache_dir()) / DEMO_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=target.parent))
    try:
        make_tiny_model(
            tmp, arch="gpt-oss", num_layers=4, sliding_window_size=32, hidden_size=64, num_heads=4
        )
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF-format model dir (default: the demo model)")
    parser.add_argument("--served-model-name", help="the name clients see (default: dir name)")
    parser.add_argument("--replicas", type=int, default=1, help="worker groups (TP groups)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the gRPC and HTTP servers bind"
    )
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="0: any free")
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"serve the OpenAI-compatible HTTP API on this port (e.g. {DEFAULT_HTTP_PORT}; "
        "0: any free; default: no HTTP API)",
    )
    parser.add_argument(
        "--api-key-file",
        help="file holding the API key the HTTP API requires as `Authorization: Bearer <key>` "
        f"(or ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="Ray to join ('auto': the running cluster; default: start a local Ray)",
    )
    parser.add_argument(
        "--num-cpus", type=int, default=None, help="logical CPUs of a local Ray (CPU bundles)"
    )
    parser.add_argument(
        "--ray-node-ip-address",
        default=environment.ray_node_ip_address() or LOOPBACK,
        metavar="ADDR",
        help=f"address of a local Ray (default ${NODE_IP_ADDRESS_ENV}, else {LOOPBACK}: it "
        "binds loopback only; another address lets other machines join it, and Ray then "
        "listens on every interface)",
    )
    parser.add_argument(
        "--tls-cert-file",
        help="PEM certificate chain: serve gRPC and the HTTP API over TLS only",
    )
    parser.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    parser.add_argument(
        "--tls-ca-file",
        help="PEM CA bundle: mutual TLS on both ports (clients present a certificate it signed)",
    )
    parser.add_argument(
        "--auth-token-file",
        help=f"file holding the bearer token every RPC but health needs (or ${AUTH_TOKEN_ENV})",
    )
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument(
        "--status-interval-s", type=float, default=10.0, help="status line period (0: none)"
    )
    parser.add_argument(
        "--report-interval-s", type=float, default=0.1, help="worker → router report period"
    )
    parser.add_argument(
        "--use-gpu",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=None,
        metavar="true|false",
        help="GPU bundles (default: when Ray has GPUs)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="workers a request may try: a lost worker's requests migrate to another",
    )
    parser.add_argument(
        "--recreate-lost-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recreate a lost worker group (new placement group, same TP size)",
    )
    parser.add_argument(
        "--recreate-backoff-s",
        type=float,
        default=1.0,
        help="first wait before recreating a lost group again (doubles, at most 30 s)",
    )
    parser.add_argument(
        "--router-resources",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="custom Ray resources the router actor needs, e.g. '{\"cpu_pool\": 0.01}' to keep "
        "it on the nodes that have them (default: none; it asks for no CPU)",
    )
    add_config_flags(parser, EngineConfig, ENGINE_FLAGS)
    add_config_flags(parser, RouterConfig, ROUTER_FLAGS, prefix="router_")
    add_config_flags(parser, IngressLimits, LIMIT_FLAGS, prefix="limit_")


def build_configs(args: argparse.Namespace) -> tuple[ClusterConfig, GrpcServerConfig]:
    """(ClusterConfig, GrpcServerConfig) from the flags; pydantic errors propagate."""
    from swaserve.cluster.cluster import ClusterConfig
    from swaserve.cluster.grpc_server import GrpcServerConfig

    model = args.model or str(ensure_demo_model())
    engine = EngineConfig(model=model, **config_overrides(args, ENGINE_FLAGS))
    router = RouterConfig(**config_overrides(args, ROUTER_FLAGS, prefix="router_"))
    cluster = ClusterConfig(
        engine=engine,
        router=router,
        replicas=args.replicas,
        served_model_name=args.served_model_name,
        use_gpu=args.use_gpu,
        report_interval_s=args.report_interval_s,
        max_attempts=args.max_attempts,
        recreate_lost_workers=args.recreate_lost_workers,
        recreate_backoff_s=args.recreate_backoff_s,
        limits=IngressLimits(**config_overrides(args, LIMIT_FLAGS, prefix="limit_")),
        router_resources=args.router_resources or {},
    )
    token = environment.auth_token(args.auth_token_file)
    if args.auth_token_file and not token:  # refused, never served without the token
        raise ValueError(f"the auth token file {args.auth_token_file} is empty")
    grpc_config = GrpcServerConfig(
        host=args.host,
        port=args.grpc_port,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_ca_file=args.tls_ca_file,
        auth_token=token,
        drain_timeout_s=args.drain_timeout_s,
    )
    return cluster, grpc_config


def read_api_key(args: argparse.Namespace) -> str | None:
    """The HTTP API's key from --api-key-file or $SWASERVE_API_KEY (None: no auth)."""
    key = environment.api_key(args.api_key_file)
    if args.api_key_file and not key:
        raise ValueError(f"the API key file {args.api_key_file} is empty")
    return key


def connect_ray(
    address: str | None, num_cpus: int | None, bundles: int, node_ip_address: str = LOOPBACK
) -> LocalRay | None:
    """Join `address`, or start a local Ray on `node_ip_address` (in its own session, see
    `local_ray`; `set_node_address` must have run before Ray was imported) and join it;
    returns the local Ray to stop at exit."""
    import ray

    if ray.is_initialized():
        return None
    if address:
        ray.init(address=address, log_to_driver=True)
        return None
    num_cpus = num_cpus or max(os.cpu_count() or 1, bundles + 1)
    local = LocalRay(num_cpus=num_cpus, node_ip_address=node_ip_address)
    local_address = local.start()
    try:
        ray.init(address=local_address, log_to_driver=True, _node_ip_address=node_ip_address)
    except BaseException:
        local.stop()
        raise
    return local


async def serve(
    cluster_config: ClusterConfig,
    grpc_config: GrpcServerConfig,
    status_interval_s: float,
    http_port: int | None = None,
    api_key: str | None = None,
) -> int:
    from swaserve.cluster.cluster import Cluster
    from swaserve.cluster.grpc_server import GrpcServer
    from swaserve.cluster.http_server import HttpServer
    from swaserve.cluster.metrics import ServingMetrics

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cluster = await Cluster.start(cluster_config)
    info = cluster.model_info
    assert info is not None
    metrics = ServingMetrics(info.model_name)  # one registry for both ingresses
    server = GrpcServer(cluster, grpc_config, metrics)
    http = None
    if http_port is not None:
        http = HttpServer(
            cluster,
            grpc_config.host,
            http_port,
            metrics,
            api_key,
            tls_cert_file=grpc_config.tls_cert_file,
            tls_key_file=grpc_config.tls_key_file,
            tls_ca_file=grpc_config.tls_ca_file,
        )
    try:
        port = await server.start()
        host = server.config.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        tls = " (TLS)" if server.config.tls_cert_file else ""
        print(
            f"swaserve: serving {info.model_name} ({info.architecture}, "
            f"W={info.limits.sliding_window_size}) on {host}:{port}{tls}: {len(cluster.live_workers)} worker(s) × TP {info.tp_size}",
            flush=True,
        )
        print(f"try:  swaserve client --server {shown}:{port} 'Hello, swaserve!'", flush=True)
        if http is not None:
            http_port = await http.start()
            url = f"{http.scheme}://{shown}:{http_port}"
            print(f"swaserve: OpenAI-compatible HTTP API on {url}/v1", flush=True)
            auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if api_key else ""
            body = '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
            print(
                f"try:  curl {url}/v1/chat/completions{auth} "
                f"-H 'Content-Type: application/json' -d '{body}'",
                flush=True,
            )
        status = asyncio.create_task(_status_lines(cluster, status_interval_s))
        await stop.wait()
        status.cancel()
        print("swaserve: draining", flush=True)
        drained = await server.drain()  # the cluster refuses new requests: /health is 503
        if not drained:
            logger.warning("drain timed out with %d open streams; stopping", cluster.num_open)
    finally:
        await server.stop()
        try:
            await cluster.shutdown()  # streams still open end: over HTTP with an error event
        finally:
            if http is not None:
                await http.stop()
    print("swaserve: stopped", flush=True)
    return 0


async def _status_lines(cluster: Cluster, interval_s: float) -> None:
    if interval_s <= 0:
        return
    while True:
        await asyncio.sleep(interval_s)
        parts = []
        for s in await cluster.load():
            h = s.headroom
            if h is None:
                continue
            share = h.cached_tokens_total / h.prompt_tokens_total if h.prompt_tokens_total else 0.0
            parts.append(
                f"{s.worker_id}: run {h.num_running} wait {h.num_waiting} "
                f"full free {h.full_free_tokens}/{h.full_total_tokens} "
                f"swa free {h.swa_free_tokens}/{h.swa_total_tokens} cached {share:.2f}"
            )
        logger.info("status | %s", " | ".join(parts) or "no live workers")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.ray_address:
        set_auth_mode()  # before anything imports ray
        set_node_address(args.ray_node_ip_address)
    try:
        cluster_config, grpc_config = build_configs(args)
        api_key = read_api_key(args)
    except (ValidationError, OSError, ValueError) as exc:
        print(f"swaserve serve: {exc}", file=sys.stderr)
        return 2
    import ray

    bundles = args.replicas * cluster_config.engine.tp_size
    local = connect_ray(args.ray_address, args.num_cpus, bundles, args.ray_node_ip_address)
    try:
        return asyncio.run(
            serve(cluster_config, grpc_config, args.status_interval_s, args.http_port, api_key)
        )
    finally:
        ray.shutdown()
        if local is not None:
            local.stop()
