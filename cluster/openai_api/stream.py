"""A job's stream: each of its `n` choices is its own cluster request (id `<id>`, or `<id>-<i>`
when n > 1), detokenized (UTF-8 safe, stop strings), answered as one JSON body or as SSE chunks
(`data: {json}`, the last `data: [DONE]`).

A streaming request's first token is awaited before the response starts, so that routing errors
keep their status (429 with `Retry-After`, 503, 400); an error after that is a last
`data: {"error": ...}` event. A client that leaves (closed connection) closes its streams: the
requests are aborted on their workers and their KV freed. The engine's "abort" never reaches a
client as a finish reason: a request aborted on the server side ends in a 503 error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from swaserve.cluster.metrics import ServingMetrics
from swaserve.cluster.openai_api import chat as chat_api
from swaserve.cluster.openai_api.jobs import Job
from swaserve.cluster.openai_api.protocol import api_error
from swaserve.cluster.routed import ClusterError, RoutedCluster, Unavailable
from swaserve.proto.stream import TokenLogprob
from swaserve.proto.text.detokenizer import IncrementalDetokenizer
from swaserve.proto.text.parsed import Delta as ParsedDelta
from swaserve.proto.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class Delta:
    """One step of one choice: new text and tokens; `finish_reason` on its last."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    parsed: list[ParsedDelta] | None = None  # a parsed job's: reasoning, content, calls
    reasoning_tokens: int = 0  # of `token_ids`, those of the reasoning


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    reasoning_tokens: int | None = None  # counted when the output is parsed
    cached: dict[int, int] = field(default_factory=dict)  # choice -> its cached prompt tokens
    # (the prompt is counted once, so its cached tokens are the most any choice had cached)

    def add(self, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.cached[delta.index] = delta.cached_tokens
        if delta.parsed is not None:
            self.reasoning_tokens = (self.reasoning_tokens or 0) + delta.reasoning_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(self.cached.values(), default=0)},
        } | (
            {}
            if self.reasoning_tokens is None
            else {"completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}
        )


class Responder:
    """Streams jobs' choices from the cluster and writes the responses; records `metrics`
    (None: none)."""

    def __init__(self, cluster: RoutedCluster, metrics: ServingMetrics | None = None) -> None:
        self.cluster, self.metrics = cluster, metrics

    async def choice(self, job: Job, index: int) -> AsyncGenerator[Delta, None]:
        """One choice's deltas; the last has `finish_reason` ("stop" | "length"). Closing it
        early aborts the request on its worker. Raises a `ClusterError`."""
        request_id = job.request_id(index)
        tokenizer = self.cluster.tokenizer
        detok = (
            IncrementalDetokenizer(tokenizer.tokenizer, job.prompt_ids, job.stop)
            if tokenizer is not None and job.format is None
            else None
        )
        parser = None
        if job.format is not None and tokenizer is not None:
            parser = job.format.parser(tokenizer, job.prompt_ids, job.tools)
        timer = self.metrics.tracker(job.arrival_s) if self.metrics is not None else None
        stream = self.cluster.generate(
            request_id, job.prompt_ids, job.params, session_id=job.session_id
        )
        new_tokens, cached, worker, outcome = 0, 0, "", "client left"
        try:
            async for chunk in stream:
                worker, cached = chunk.worker_id, chunk.cached_tokens
                new_tokens += len(chunk.token_ids)
                if timer is not None:
                    timer.tokens(len(chunk.token_ids), worker, time.monotonic())
                text = detok.push(chunk.token_ids) if detok is not None else ""
                reason = chunk.finish_reason
                if detok is not None and detok.stopped:
                    reason = "stop"  # a stop string: end here; closing the stream aborts
                elif chunk.finished and detok is not None:
                    text += detok.flush()
                if reason == "abort":
                    raise Unavailable(f"request {request_id} was aborted on the server")
                outcome = reason or outcome
                parsed, reasoning = None, 0
                if parser is not None:
                    before = parser.reasoning_tokens
                    parsed, ended = parser.chunk(chunk.token_ids, chunk.finished, reason or "")
                    reason = ended or None
                    reasoning = parser.reasoning_tokens - before
                yield Delta(
                    index, text, chunk.token_ids, reason, cached, chunk.logprobs, parsed, reasoning
                )
                if reason:
                    return
        except ClusterError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await stream.aclose()  # not finished: aborts on the worker, frees the KV
            if timer is not None:
                timer.finish(time.monotonic())
            logger.info(
                "request %s: %d prompt tokens (%d cached) + %d new on %s, %s, %.3f s",
                request_id,
                len(job.prompt_ids),
                cached,
                new_tokens,
                worker or "-",
                outcome,
                time.monotonic() - job.arrival_s,
            )

    async def respond(self, request: Request, job: Job, stream: bool) -> Response:
        choices = [self.choice(job, i) for i in range(job.n)]
        if not stream:
            collected = await _unless_client_leaves(request, [_collect(c) for c in choices])
            return Response(status_code=499) if collected is None else self._body(job, collected)
        try:
            firsts = await _unless_client_leaves(request, [_first(c) for c in choices])
        except BaseException:
            await _close(choices)  # each is done or waits at a yield: none is running
            raise
        if firsts is None:
            await _close(choices)
            return Response(status_code=499)
        return _EventStream(self._events(job, choices, firsts))

    def _body(self, job: Job, choices: list[list[Delta]]) -> JSONResponse:
        usage = Usage(len(job.prompt_ids))
        out = []
        for index, deltas in enumerate(choices):
            for d in deltas:
                usage.add(d)
            text = "".join(d.text for d in deltas)
            choice: dict[str, Any] = {"index": index}
            if job.format is not None:
                parsed = chat_api.ParsedChoice()
                for d in deltas:
                    parsed.add(d.parsed or ())
                choice["message"] = parsed.message()
            elif job.kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            logprobs = [e for d in deltas for e in d.logprobs or ()]
            choice |= {
                "logprobs": self._logprobs(job, logprobs, 0),
                "finish_reason": deltas[-1].finish_reason,
            }
            if job.return_token_ids:
                choice["token_ids"] = [t for d in deltas for t in d.token_ids]
                choice["prompt_token_ids"] = job.prompt_ids
            out.append(choice)
        return JSONResponse(self._envelope(job, job.kind, out) | {"usage": usage.body()})

    def _logprobs(
        self, job: Job, entries: list[TokenLogprob], text_offset: int
    ) -> dict[str, Any] | None:
        """A choice's `logprobs` in OpenAI's shape for the endpoint (None when not asked)."""
        if job.params.logprobs is None:
            return None
        tokenizer = self.cluster.tokenizer
        if job.kind == "chat.completion":
            return chat_logprobs(entries, tokenizer)
        return completion_logprobs(entries, tokenizer, text_offset)

    def _envelope(self, job: Job, kind: str, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": job.response_id,
            "object": kind,
            "created": job.created,
            "model": job.model,
            "choices": choices,
        }

    async def _events(
        self, job: Job, choices: list[AsyncGenerator[Delta, None]], firsts: list[Delta]
    ) -> AsyncGenerator[str, None]:
        chat = job.kind == "chat.completion"
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage = Usage(len(job.prompt_ids))
        offsets = [0] * job.n  # text so far of each choice (completions' text_offset)
        calls: list[list[dict[str, Any]]] = [[] for _ in range(job.n)]  # parsed jobs: calls started

        def event(d: Delta, first: bool) -> str | None:
            usage.add(d)
            offset = offsets[d.index]
            offsets[d.index] += len(d.text)
            fields = chat_api.delta_fields(d.parsed, calls[d.index]) if d.parsed else {}
            if not (
                first or d.text or d.finish_reason or job.return_token_ids or d.logprobs or fields
            ):
                return None
            choice: dict[str, Any] = {"index": d.index}
            if job.format is not None:
                delta = {"role": "assistant", "content": ""} if first else {}
                choice["delta"] = delta | fields
            elif chat:
                delta = {"role": "assistant"} if first else {}
                choice["delta"] = delta | ({"content": d.text} if d.text or first else {})
            else:
                choice["text"] = d.text
            choice |= {
                "logprobs": self._logprobs(job, d.logprobs or [], offset),
                "finish_reason": d.finish_reason,
            }
            if job.return_token_ids:
                choice["token_ids"] = d.token_ids
                if first:
                    choice["prompt_token_ids"] = job.prompt_ids
            body = self._envelope(job, kind, [choice])
            return _sse(body | {"usage": None} if job.include_usage else body)

        done_early = [c for c, d in zip(choices, firsts, strict=True) if d.finish_reason]
        merged = _merge([c for c, d in zip(choices, firsts, strict=True) if not d.finish_reason])
        try:
            for d in firsts:
                if (line := event(d, first=True)) is not None:
                    yield line
            async for d in merged:
                if (line := event(d, first=False)) is not None:
                    yield line
            if job.include_usage:
                yield _sse(self._envelope(job, kind, []) | {"usage": usage.body()})
            yield "data: [DONE]\n\n"
        except Exception as exc:
            yield _sse(api_error(exc).body())
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()  # closes the choices it merges
            await _close(done_early)


def token_text(tokenizer: TextTokenizer | None, token_id: int) -> str:
    """One token's text (special tokens included; without a tokenizer, "token_id:N")."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode_with_specials([token_id])


def chat_logprobs(entries: list[TokenLogprob], tokenizer: TextTokenizer | None) -> dict[str, Any]:
    """Chat's shape: `{"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal"}`."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        one(e.token_id, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: list[TokenLogprob], tokenizer: TextTokenizer | None, text_offset: int
) -> dict[str, Any]:
    """The completions API's shape: parallel lists of tokens, their log-probabilities, their
    top alternatives as {token: logprob}, and where each token's text starts."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends, so that its
    requests are aborted as soon as the client leaves (not when the generator is collected)."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # ASGI 2.4 servers: the client left while a chunk was being sent
        finally:
            await self.events.aclose()


async def _close(choices: list[AsyncGenerator[Delta, None]]) -> None:
    for choice in choices:
        await choice.aclose()


async def _first(choice: AsyncGenerator[Delta, None]) -> Delta:
    return await anext(choice)


async def _collect(choice: AsyncGenerator[Delta, None]) -> list[Delta]:
    try:
        return [d async for d in choice]
    finally:
        await choice.aclose()


async def _merge(choices: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[Delta, None]:
    """The deltas of several choices as they come; closes them all however it ends."""
    queue: asyncio.Queue[Delta | Exception | None] = asyncio.Queue()

    async def pump(choice: AsyncGenerator[Delta, None]) -> None:
        try:
            async for d in choice:
                queue.put_nowait(d)
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            await choice.aclose()

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has closed the connection (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request: Request, coros: list[Awaitable[T]]) -> list[T] | None:
    """Runs `coros` concurrently: their results, or None when the client leaves first. The
    first exception cancels the rest and is raised. Returns only once every task ended."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    left = asyncio.ensure_future(_disconnected(request.receive))
    try:
        pending: set[asyncio.Future[Any]] = {*tasks, left}
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if left in done:
                return None
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
    finally:
        for task in (*tasks, left):
            task.cancel()
        await asyncio.gather(*tasks, left, return_exceptions=True)
