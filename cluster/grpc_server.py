"""The gRPC ingress (grpc.aio): service `swaserve.v1.Inference` over a cluster, plus the
standard `grpc.health.v1.Health` service and server reflection.

    Generate(request)  →  validate (INVALID_ARGUMENT)  →  tokenize (text) / check ids
                       →  cluster.generate: route + stream  →  detokenize (UTF-8 safe, stop
                          strings)  →  GenerateResponse items; the last one has finish_reason
                          and usage

Status codes: INVALID_ARGUMENT for bad input, RESOURCE_EXHAUSTED when no worker has room and
the router's queue is full (trailing metadata `retry-after-s`), UNAVAILABLE while draining or
when the request was lost on every worker it may try, INTERNAL when the worker's step failed,
UNAUTHENTICATED without the configured bearer token. A client cancel or an expired deadline
closes the stream, which aborts the request on its worker and frees its KV; the deadline also
bounds the router's queue wait and the request's migrations (`timeout_s`). Nothing a client
sends is unpickled: requests are protobuf, parsed by protobuf. Tokenizing and checking a
prompt run off the event loop, so one huge prompt does not stall the other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from swaserve.cluster.defaults import DEFAULT_GRPC_PORT
from swaserve.cluster.ingress_limits import client_key
from swaserve.cluster.metrics import ServingMetrics
from swaserve.cluster.request_checks import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BadRequest,
    check_id,
    check_stop_strings,
)
from swaserve.cluster.routed import (
    ClusterBusy,
    GenerationFailed,
    InvalidRequest,
    ModelInfo,
    RateLimited,
    RoutedCluster,
    Unavailable,
)
from swaserve.cluster.tls_files import TLSFiles, TLSMaterial, check_tls_files
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import TokenLogprob
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.proto.text.detokenizer import IncrementalDetokenizer
from swaserve.proto.text.formats import chat_format
from swaserve.proto.text.parsed import Delta as ParsedDelta
from swaserve.proto.text.parsed import OutputParser
from swaserve.proto.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "swaserve.v1.Inference"
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
UNAUTHENTICATED_DETAILS = "missing or wrong bearer token"


class GrpcServerConfig(BaseModel):
    """The ingress's knobs; `swaserve serve` maps its flags onto these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address to bind (0.0.0.0: every interface)")
    port: int = Field(DEFAULT_GRPC_PORT, ge=0, le=65535, description="0: any free port")
    tls_cert_file: str | None = Field(None, description="PEM certificate chain: serve TLS")
    tls_key_file: str | None = Field(None, description="PEM private key of the certificate")
    tls_ca_file: str | None = Field(
        None,
        description="PEM CA bundle: mutual TLS, every client presents a certificate it signed "
        "(the HTTP port too)",
    )
    auth_token: str | None = Field(None, description="bearer token every RPC but health needs")
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, gt=0, le=1 << 30)
    drain_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: wait this long for streams")

    @model_validator(mode="after")
    def _tls_pair(self) -> GrpcServerConfig:
        check_tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        for path in (self.tls_cert_file, self.tls_key_file, self.tls_ca_file):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path!r} does not exist")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token must not be empty")
        return self


def sampling_params_from_proto(msg: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    """Protobuf → `SamplingParams`; unset optional fields keep swaserve's defaults. Raises
    `BadRequest` with the field's name."""
    values: dict[str, Any] = {}
    optional = (
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "num_speculative_tokens",
    )
    for name in optional:
        if msg.HasField(name):
            values[name] = getattr(msg, name)
    if msg.logit_bias:
        values["logit_bias"] = dict(msg.logit_bias)
    if msg.stop:
        values["stop"] = tuple(msg.stop)
    if msg.HasField("structured_outputs"):
        values["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    if msg.stop_token_ids:
        bad = [t for t in msg.stop_token_ids if t >= vocab_size]
        if bad:
            raise BadRequest(
                f"sampling_params.stop_token_ids: {bad[0]} is outside [0, {vocab_size})"
            )
        values["stop_token_ids"] = tuple(msg.stop_token_ids)
    values["ignore_eos"] = msg.ignore_eos
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"sampling_params.{field}: {first['msg']}") from None


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> dict[str, Any]:
    """The `StructuredOutputs` fields of the message's one set kind (`BadRequest` if none)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise BadRequest("sampling_params.structured_outputs: set one of its fields")
    if kind == "choice":
        return {"choice": tuple(msg.choice.choices)}
    return {kind: getattr(msg, kind)}


def logprobs_to_proto(
    entries: list[TokenLogprob], tokenizer: TextTokenizer | None
) -> list[pb.TokenLogprob]:
    """`TokenLogprob`s as messages, with each token's text (empty without a tokenizer)."""

    def text(token_id: int) -> str:
        return "" if tokenizer is None else tokenizer.decode_with_specials([token_id])

    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            token=text(e.token_id),
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v, token=text(t)) for t, v in e.top],
        )
        for e in entries
    ]


class RpcFailure(Exception):
    """How an RPC ends when it fails: a status code, details, trailing metadata."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by Ray Serve: keep every field
        return type(self), (self.code, self.details, self.trailing)


class InferenceService:
    """The logic of `swaserve.v1.Inference` over a `RoutedCluster`, apart from any transport:
    methods take and return protobuf messages and raise `RpcFailure`. `InferenceServicer`
    serves it with grpc.aio; the Serve app through Serve's gRPC proxy."""

    def __init__(self, cluster: RoutedCluster, metrics: ServingMetrics | None = None) -> None:
        self.cluster = cluster
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(cluster)
        self._open: set[str] = set()

    @property
    def info(self) -> ModelInfo:
        info = self.cluster.model_info
        assert info is not None, "start the cluster first"
        return info

    async def generate(
        self,
        request: pb.GenerateRequest,
        timeout_s: float | None = None,
        client: str = "peer:unknown",
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The stream of one request. `timeout_s`: what is left of the client's deadline (None:
        none); it bounds the router's queue wait and the request's migrations. `client`: whose
        budget it counts against (`ingress_limits.client_key`; held until the stream ends)."""
        started = time.monotonic()
        await self.cluster.ready()
        try:
            lease = self.cluster.admit(client)
        except RateLimited as exc:
            raise _busy(exc) from None
        try:
            async for item in self._generate(request, timeout_s, started):
                yield item
        finally:
            lease.release()

    async def _generate(
        self, request: pb.GenerateRequest, timeout_s: float | None, started: float
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        try:
            parsed = await asyncio.to_thread(self._parse, request)  # tokenizing may be long
            request_id, token_ids, params, stop, session = parsed
        except (BadRequest, InvalidRequest) as exc:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if request_id in self._open:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request_id!r} is already in use"
            )
        tokenizer = self.cluster.tokenizer
        detok = (
            IncrementalDetokenizer(tokenizer.tokenizer, token_ids, stop)
            if tokenizer is not None
            else None
        )
        parser = self._output_parser(request.parse_output, token_ids)
        self._open.add(request_id)
        left_s = None if timeout_s is None else timeout_s - (time.monotonic() - started)
        stream = self.cluster.generate(
            request_id, token_ids, params, session_id=session, timeout_s=left_s
        )
        timer = self.metrics.tracker(started) if self.metrics is not None else None
        completion_tokens = 0
        worker_id = ""
        try:
            async for chunk in stream:
                worker_id = chunk.worker_id
                completion_tokens += len(chunk.token_ids)
                if timer is not None:
                    timer.tokens(len(chunk.token_ids), worker_id, time.monotonic())
                text = detok.push(chunk.token_ids) if detok is not None else ""
                reason = chunk.finish_reason or ""
                parts: list[ParsedDelta] = []
                if parser is not None:
                    parts, reason = parser.chunk(chunk.token_ids, chunk.finished, reason)
                if detok is not None and detok.stopped:
                    reason = "stop"  # a stop string: end here; closing the stream aborts
                elif chunk.finished and detok is not None:
                    text += detok.flush()
                response = pb.GenerateResponse(
                    request_id=request_id,
                    token_ids=chunk.token_ids,
                    text=text,
                    finish_reason=reason,
                    cached_tokens=chunk.cached_tokens,
                    worker_id=worker_id,
                    logprobs=logprobs_to_proto(chunk.logprobs or [], tokenizer),
                    parsed=[
                        pb.OutputPart(
                            kind=p.kind, text=p.text, tool_name=p.name or "", tool_index=p.index
                        )
                        for p in parts
                    ],
                )
                if reason:
                    response.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=len(token_ids),
                            completion_tokens=completion_tokens,
                            cached_tokens=chunk.cached_tokens,
                        )
                    )
                yield response
                if reason:
                    logger.info(
                        "request %s: %d prompt tokens (%d cached) + %d new on %s, %s, %.3f s",
                        request_id,
                        len(token_ids),
                        chunk.cached_tokens,
                        completion_tokens,
                        worker_id,
                        reason,
                        time.monotonic() - started,
                    )
                    break
        except InvalidRequest as exc:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except ClusterBusy as exc:
            raise _busy(exc) from None
        except Unavailable as exc:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except GenerationFailed as exc:
            raise RpcFailure(grpc.StatusCode.INTERNAL, str(exc)) from None
        finally:
            self._open.discard(request_id)
            await stream.aclose()  # not finished: aborts on the worker, frees the KV
            if timer is not None:
                timer.finish(time.monotonic())

    def _output_parser(self, wanted: bool, prompt_ids: list[int]) -> OutputParser | None:
        """The request's output parser (`parse_output`); None when not asked."""
        if not wanted:
            return None
        tokenizer = self.cluster.tokenizer
        fmt = chat_format(tokenizer)
        if fmt is None or tokenizer is None:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                "parse_output needs a model whose output swaserve parses (harmony: GPT-OSS; "
                "MiMo-V2-Flash's <think> / <tool_call> format)",
            )
        return fmt.parser(tokenizer, prompt_ids)

    def _parse(
        self, request: pb.GenerateRequest
    ) -> tuple[str, list[int], SamplingParams, list[str], str | None]:
        request_id = (
            check_id(request.request_id, "request_id")
            if request.request_id
            else self.cluster.new_request_id()
        )
        session = check_id(request.session_id, "session_id") if request.session_id else None
        has_text, has_ids = bool(request.text), bool(request.token_ids)
        if has_text == has_ids:
            raise BadRequest("set exactly one of text and token_ids")
        if has_text:
            tokenizer = self.cluster.tokenizer
            if tokenizer is None:
                raise BadRequest("this model has no tokenizer: send token_ids")
            token_ids = tokenizer.encode(request.text)
        else:
            token_ids = list(request.token_ids)
        params = sampling_params_from_proto(request.sampling_params, self.info.vocab_size)
        default = self.cluster.limits.default_max_tokens(params.max_new_tokens)
        if default != params.max_new_tokens and not request.sampling_params.HasField(
            "max_new_tokens"
        ):
            params = params.model_copy(update={"max_new_tokens": default})
        stop = check_stop_strings(list(request.sampling_params.stop))
        if stop and self.cluster.tokenizer is None:
            raise BadRequest("sampling_params.stop needs a tokenizer: use stop_token_ids")
        self.cluster.check_request(token_ids, params)
        return request_id, token_ids, params, stop, session

    async def abort(self, request: pb.AbortRequest) -> pb.AbortResponse:
        if not request.request_id:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        return pb.AbortResponse(aborted=await self.cluster.abort(request.request_id))

    async def model_info(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:
        await self.cluster.ready()
        return pb.ModelInfo(**self.info.public_fields(), num_workers=len(self.cluster.live_workers))

    async def load(self, request: pb.GetLoadRequest) -> pb.LoadResponse:
        await self.cluster.ready()
        out = pb.LoadResponse()
        for status in await self.cluster.load():
            h = status.headroom
            if h is None:
                continue
            out.workers.append(
                pb.WorkerLoad(
                    worker_id=status.worker_id,
                    full_total_tokens=h.full_total_tokens,
                    full_free_tokens=h.full_free_tokens,
                    full_evictable_tokens=h.full_evictable_tokens,
                    swa_total_tokens=h.swa_total_tokens,
                    swa_free_tokens=h.swa_free_tokens,
                    swa_evictable_tokens=h.swa_evictable_tokens,
                    num_running=h.num_running,
                    num_waiting=h.num_waiting,
                    cached_token_share=(
                        h.cached_tokens_total / h.prompt_tokens_total
                        if h.prompt_tokens_total
                        else 0.0
                    ),
                    report_age_s=max(0.0, status.report_age_s),
                    tp_size=self.info.tp_size,
                )
            )
        return out


def _busy(exc: ClusterBusy) -> RpcFailure:
    trailing = (("retry-after-s", f"{exc.retry_after_s:g}"),)
    return RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailing)


def grpc_client(context: Any, authenticated: bool) -> str:
    """Whose budget a call counts against (`ingress_limits.client_key`): the bearer token it
    carries when the server requires one (already checked), else its peer's address."""
    credential = None
    if authenticated and context is not None:
        credential = str(dict(context.invocation_metadata() or ()).get("authorization", ""))
    return client_key(credential, context.peer() if context is not None else None)


class InferenceServicer(pb_grpc.InferenceServicer):
    """`InferenceService` on a grpc.aio server. `authenticated`: the server requires a token
    (its interceptor checks it), so a call counts against its token's budget."""

    def __init__(self, service: InferenceService, authenticated: bool = False) -> None:
        self.service, self.authenticated = service, authenticated

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        items = self.service.generate(
            request,
            timeout_s=context.time_remaining(),
            client=grpc_client(context, self.authenticated),
        )
        try:
            async with contextlib.aclosing(items):
                async for item in items:
                    yield item
        except RpcFailure as failure:
            await _abort(context, failure)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        try:
            return await self.service.abort(request)
        except RpcFailure as failure:
            await _abort(context, failure)
            raise

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return await self.service.model_info(request)

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadResponse:
        return await self.service.load(request)


async def _abort(context: grpc.aio.ServicerContext, failure: RpcFailure) -> None:
    if failure.trailing:
        context.set_trailing_metadata(failure.trailing)
    await context.abort(failure.code, failure.details)


class BearerToken:
    """The rule of the gRPC API's token, wherever a call comes in (this server's interceptor,
    the Serve app's ingress): the call's metadata carries `authorization: Bearer <token>`,
    compared in constant time."""

    def __init__(self, token: str) -> None:
        if not token.strip():
            raise ValueError("the bearer token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def allows(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        given = dict(metadata or ()).get("authorization", "")
        given_bytes = given if isinstance(given, bytes) else str(given).encode()
        return hmac.compare_digest(given_bytes, self._expected)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but the health service needs `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._token = BearerToken(token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if method.startswith(f"/{HEALTH_SERVICE_NAME}/") or handler is None:
            return handler
        if self._token.allows(handler_call_details.invocation_metadata):
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)
        yield  # pragma: no cover (abort raises)

    kinds = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kinds]
    return make(
        deny_stream if handler.response_streaming else deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class GrpcServer:
    """The ingress server: Inference + Health + reflection on one port."""

    def __init__(
        self,
        cluster: RoutedCluster,
        config: GrpcServerConfig,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.metrics = metrics
        self.health = health.aio.HealthServicer()
        self.tls: TLSFiles | None = None  # with TLS: its files, re-read when rotated
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Bind and serve; returns the port (the free one chosen when the config says 0)."""
        config = self.config
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        pb_grpc.add_InferenceServicer_to_server(
            InferenceServicer(
                InferenceService(self.cluster, self.metrics), config.auth_token is not None
            ),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        address = f"{config.host}:{config.port}"
        if config.tls_cert_file and config.tls_key_file:
            port = server.add_secure_port(address, self._credentials(config))
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind the gRPC server to {address}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.server, self.port = server, port
        return port

    def _credentials(self, config: GrpcServerConfig) -> grpc.ServerCredentials:
        """TLS (mutual with a client CA) whose files are read again at a new connection's
        handshake when they changed (`TLSFiles`): a rotated certificate needs no restart."""
        assert config.tls_cert_file and config.tls_key_file
        self.tls = files = TLSFiles(config.tls_cert_file, config.tls_key_file, config.tls_ca_file)

        def configuration(m: TLSMaterial) -> Any:
            return grpc.ssl_server_certificate_configuration(
                [(m.private_key, m.cert_chain)], root_certificates=m.client_ca
            )

        def fetch() -> Any:
            material = files.changed()
            return None if material is None else configuration(material)

        return grpc.dynamic_ssl_server_credentials(
            configuration(files.material),
            fetch,
            require_client_authentication=config.tls_ca_file is not None,
        )

    async def drain(self) -> bool:
        """Health NOT_SERVING, refuse new requests, wait (bounded) for the open streams."""
        await self.health.enter_graceful_shutdown()
        return await self.cluster.drain(self.config.drain_timeout_s)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
