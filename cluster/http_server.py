"""`HttpServer`: the OpenAI-compatible app (`openai_api`) on uvicorn, in the caller's asyncio
loop, next to the gRPC server. It installs no signal handlers: whoever runs the loop
(`swaserve serve`) owns SIGTERM and calls `stop()` after draining."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from swaserve.cluster.defaults import DEFAULT_HTTP_PORT
from swaserve.cluster.metrics import ServingMetrics
from swaserve.cluster.openai_api import OpenAIServer, build_openai_app
from swaserve.cluster.routed import RoutedCluster

STARTUP_TIMEOUT_S = 30.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # leave SIGINT / SIGTERM to the loop's owner


class HttpServer:
    """`await start()` binds (port 0: a free one) and serves; `await stop()` ends it."""

    def __init__(
        self,
        cluster: RoutedCluster,
        host: str = "127.0.0.1",
        port: int = DEFAULT_HTTP_PORT,
        metrics: ServingMetrics | None = None,
        api_key: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.host = host
        self.requested_port = port
        self.app = build_openai_app()
        self.app.state.openai = OpenAIServer(cluster, metrics, api_key)
        self.port: int | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port. Raises `OSError` when the address is taken."""
        family = socket.getaddrinfo(self.host, self.requested_port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((self.host, self.requested_port), family=family)
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.requested_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        server = _Server(config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]))
        self._server = server
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while not server.started:
            if self._task.done() or asyncio.get_running_loop().time() > deadline:
                sock.close()
                await self.stop()
                raise OSError(f"the HTTP server on {self.host}:{self.requested_port} did not start")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Stop accepting; open responses get a second to end, then their tasks are cancelled
        (which aborts their requests). Drain, or stop the cluster, first to end them cleanly."""
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await task
