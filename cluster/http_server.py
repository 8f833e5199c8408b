"""`HttpServer`: the OpenAI-compatible app (`openai_api`) on uvicorn, in the caller's asyncio
loop, next to the gRPC server. It installs no signal handlers: whoever runs the loop
(`swaserve serve`) owns SIGTERM and calls `stop()` after draining."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn

from swaserve.cluster.defaults import DEFAULT_HTTP_PORT
from swaserve.cluster.metrics import ServingMetrics
from swaserve.cluster.openai_api import OpenAIServer, build_openai_app
from swaserve.cluster.routed import RoutedCluster
from swaserve.cluster.tls_files import TLS_POLL_S, TLSFiles, check_tls_files

logger = logging.getLogger(__name__)

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
        *,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_ca_file: str | None = None,
        tls_poll_s: float = TLS_POLL_S,
    ) -> None:
        """`tls_cert_file` / `tls_key_file`: serve HTTPS only; `tls_ca_file`: and require a
        client certificate signed by it (mutual TLS). The files are `GrpcServerConfig`'s, and
        are looked at every `tls_poll_s`: a rotated certificate is served to new connections
        (`reload_tls`)."""
        check_tls_files(tls_cert_file, tls_key_file, tls_ca_file)
        self.tls = None
        if tls_cert_file is not None and tls_key_file is not None:
            self.tls = TLSFiles(tls_cert_file, tls_key_file, tls_ca_file)
        self.tls_poll_s = tls_poll_s
        self._tls_task: asyncio.Task[None] | None = None
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
        tls = self.tls
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.requested_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
            ssl_certfile=None if tls is None else tls.cert_file,
            ssl_keyfile=None if tls is None else tls.key_file,
            ssl_ca_certs=None if tls is None else tls.ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.ca_file else ssl.CERT_NONE,
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
        if self.tls is not None:
            self._tls_task = asyncio.create_task(self._watch_tls())
        return self.port

    def reload_tls(self) -> bool:
        """Serve the certificate (and client CA) now on disk to new connections, when the
        files changed; whether they did. A client CA is added to the trusted ones: one removed
        stays trusted until a restart (the listening socket keeps its SSL context)."""
        context = None if self._server is None else self._server.config.ssl
        if self.tls is None or context is None:
            return False
        material = self.tls.changed()
        if material is None:
            return False
        try:
            context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
            if self.tls.ca_file is not None:
                context.load_verify_locations(self.tls.ca_file)
        except (OSError, ssl.SSLError) as exc:  # rotated again meanwhile: the next poll
            logger.warning("the rotated TLS files did not load (%s)", exc)
            return False
        return True

    async def _watch_tls(self) -> None:
        while True:
            await asyncio.sleep(self.tls_poll_s)
            self.reload_tls()

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    async def stop(self) -> None:
        """Stop accepting; open responses get a second to end, then their tasks are cancelled
        (which aborts their requests). Drain, or stop the cluster, first to end them cleanly."""
        if self._tls_task is not None:
            self._tls_task.cancel()
            self._tls_task = None
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await task
