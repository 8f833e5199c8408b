"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) over the
chat machinery: a request becomes a chat request (its items become messages), runs as one
choice, and its parsed output becomes output items.

    input      a string, or items: messages (roles user / system / developer / assistant,
               content as text or input_text / output_text parts), function_call,
               function_call_output (its call_id must answer an earlier call: else 400),
               reasoning (its reasoning_text, or its encrypted_content)
    instructions, system and developer messages → the developer message's instructions
    tools      function tools, and namespace tools holding function tools (named
               `namespace.name` to the model; calls come back with `namespace` and `name`
               apart); hosted tools swaserve cannot run (web_search, ...) are not offered, and
               a tool_choice that forces one is a 400
    reasoning.effort, max_output_tokens, temperature, top_p, text.format (json_schema /
               json_object: the final answer only), tool_choice, user / prompt_cache_key
    store      (default true) keeps the response, bounded (`ResponseStore`: least recently
               used first out); previous_response_id continues one (404 when it is unknown or
               was evicted); GET / DELETE a stored response
    output     reasoning items (`reasoning_text`; with include reasoning.encrypted_content an
               opaque `encrypted_content` from which a later request renders the very same
               reasoning, so its prompt matches the cache), one message with output_text,
               function_call items; status "completed", or "incomplete" (max_output_tokens)
    stream     response.created → in_progress → per item: output_item.added,
               (content_part.added, output_text.delta…, output_text.done, content_part.done |
               reasoning_text.delta…, reasoning_text.done | function_call_arguments.delta…,
               function_call_arguments.done), output_item.done → response.completed; every event
               has a monotonic sequence_number
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from swaserve.cluster.openai_api.jobs import JobBuilder
from swaserve.cluster.openai_api.protocol import APIError, ChatCompletionRequest, _off
from swaserve.cluster.openai_api.stream import Delta, Responder

STORE_SIZE = 1024
"""Responses a server keeps for previous_response_id and GET."""

HOSTED_TOOLS = {
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
}
ENCRYPTED_REASONING = "reasoning.encrypted_content"


class ResponsesRequest(BaseModel):
    """The fields swaserve takes; others are refused by name (`UNSUPPORTED`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None  # effort, summary
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None  # format, verbosity
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    seed: int | None = None


UNSUPPORTED = dict.fromkeys(
    ("background", "conversation", "prompt", "top_logprobs", "stream_options"), _off()
)
"""Fields refused by name, unless at their neutral value (false, null, empty)."""


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation so far as chat messages, output included
    session: str  # the conversation's session key for the router (its first response's)


@dataclass(slots=True)
class History:
    """What a request continues: the earlier messages (none for a first turn) and the
    conversation's session key, which routes every turn of it as one session."""

    messages: list[dict[str, Any]]
    session: str


class ResponseStore:
    """The last `capacity` stored responses, least recently used out first. `lookup`, `put`
    and `remove` are plain calls (a Serve deployment holds one for every ingress replica:
    `cluster.serve`); the service awaits `get`, `save` and `delete`."""

    def __init__(self, capacity: int = STORE_SIZE) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def lookup(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def remove(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    async def save(self, response_id: str, stored: Stored) -> None:
        self.put(response_id, stored)

    async def get(self, response_id: str) -> Stored:
        return _found(self.lookup(response_id), response_id, self.capacity)

    async def delete(self, response_id: str) -> None:
        _found(self.remove(response_id) or None, response_id, self.capacity)


class SharedResponseStore:
    """A `ResponseStore` in another process, through a handle whose `lookup`, `put` and
    `remove` return awaitables (a Serve deployment's): every ingress replica sees one store."""

    def __init__(self, handle: Any, capacity: int = STORE_SIZE) -> None:
        self.handle, self.capacity = handle, capacity

    async def save(self, response_id: str, stored: Stored) -> None:
        await self.handle.put.remote(response_id, stored)

    async def get(self, response_id: str) -> Stored:
        stored = await self.handle.lookup.remote(response_id)
        return _found(stored, response_id, self.capacity)

    async def delete(self, response_id: str) -> None:
        removed = await self.handle.remove.remote(response_id)
        _found(removed or None, response_id, self.capacity)


def _found(stored: Any, response_id: str, capacity: int) -> Any:
    if stored is None:
        raise APIError(
            404,
            f"no stored response {response_id!r} (unknown, deleted, or evicted: the server "
            f"keeps the last {capacity})",
            param="previous_response_id",
            code="not_found",
        )
    return stored


def encrypt_reasoning(text: str) -> str:
    """The opaque blob of a reasoning item (every replica decodes it: no key to share)."""
    return base64.urlsafe_b64encode(json.dumps({"v": 1, "text": text}).encode()).decode()


def decrypt_reasoning(blob: str, where: str) -> str:
    try:
        data = json.loads(base64.urlsafe_b64decode(blob.encode()))
        return str(data["text"])
    except (ValueError, KeyError, TypeError):
        raise APIError(
            400, f"{where}: encrypted_content is not one this server made", param="input"
        ) from None


# ---- request → chat request ----------------------------------------------------------------
@dataclass(slots=True)
class Translated:
    chat: ChatCompletionRequest
    new_messages: list[dict[str, Any]]  # this request's input as chat messages
    namespaces: dict[str, str] = field(default_factory=dict)  # model-side name -> namespace


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text", "reasoning_text"):
                texts.append(str(part.get("text", "")))
            else:
                raise APIError(
                    400,
                    f"{where}.content[{j}]: only text parts are supported, not {kind!r}",
                    param="input",
                )
        return "\n".join(texts)
    if content is None:
        return ""
    raise APIError(400, f"{where}.content must be a string or a list of text parts", param="input")


def input_messages(
    items: str | list[dict[str, Any]], known_calls: set[str]
) -> list[dict[str, Any]]:
    """Input items as chat messages; `known_calls`: call ids of earlier function calls (this
    request's are added)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    pending_reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400,
                    f"{where}.role {role!r} is not user, system, developer or assistant",
                    param="input",
                )
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if pending_reasoning:
                    message["reasoning_content"] = "\n".join(pending_reasoning)
                    pending_reasoning = []
                out.append(message)
            else:
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            blob = item.get("encrypted_content")
            if blob:
                pending_reasoning.append(decrypt_reasoning(blob, where))
            else:
                pending_reasoning.append(_text_of(item.get("content") or [], where))
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise APIError(
                    400, f"{where}: a function_call needs call_id and name", param="input"
                )
            namespace = item.get("namespace")
            call = {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": f"{namespace}.{name}" if namespace else name,
                    "arguments": str(item.get("arguments") or "{}"),
                },
            }
            last = out[-1] if out else None
            if (
                last is not None
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not pending_reasoning
            ):
                last["tool_calls"].append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if pending_reasoning:
                    message["reasoning_content"] = "\n".join(pending_reasoning)
                    pending_reasoning = []
                out.append(message)
            known_calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_calls:
                raise APIError(
                    400,
                    f"{where}: function_call_output {call_id!r} answers no earlier function_call",
                    param="input",
                )
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported", param="input")
    if pending_reasoning:  # reasoning of the turn still under way: keep it
        out.append(
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "\n".join(pending_reasoning),
            }
        )
    return out


def function_tools(
    tools: list[dict[str, Any]] | None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(chat function tools, model-side name → namespace) of the request's tools; hosted tools
    are left out."""
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}

    def add(tool: dict[str, Any], namespace: str | None) -> None:
        name = tool.get("name")
        if not isinstance(name, str):
            raise APIError(400, "a function tool needs a name", param="tools")
        full = f"{namespace}.{name}" if namespace else name
        if namespace:
            namespaces[full] = namespace
        fn = {
            "name": full,
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": tool.get("strict"),
        }
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})

    for tool in tools or ():
        kind = tool.get("type")
        if kind == "function":
            add(tool, None)
        elif kind == "namespace":
            for inner in tool.get("tools") or ():
                if inner.get("type", "function") == "function":
                    add(inner, str(tool.get("name")))
        elif kind in HOSTED_TOOLS or kind == "custom":
            continue  # not something this server runs: not offered to the model
        else:
            raise APIError(400, f"tools: type {kind!r} is not supported", param="tools")
    return out, namespaces


def translate(req: ResponsesRequest, history: History) -> Translated:
    known = {c["id"] for m in history.messages for c in m.get("tool_calls") or ()}
    new = input_messages(req.input, known)
    tools, namespaces = function_tools(req.tools)
    messages = []
    if req.instructions:
        messages.append({"role": "developer", "content": req.instructions})
    messages += history.messages + new
    choice = req.tool_choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in HOSTED_TOOLS:
            raise APIError(
                400,
                f"tool_choice forces {kind!r}, which this server cannot run",
                param="tool_choice",
            )
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "max_tokens": req.max_output_tokens,
        "user": req.user,
        # a conversation is one session for the router unless the client names its own
        "prompt_cache_key": req.prompt_cache_key or (None if req.user else history.session),
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        if fmt["type"] == "json_object":
            body["response_format"] = {"type": "json_object"}
        else:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": fmt.get("name", "format"),
                    "schema": fmt.get("schema"),
                    "strict": fmt.get("strict"),
                },
            }
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValueError as exc:
        raise APIError(
            400, f"the request does not translate to a valid conversation: {exc}"
        ) from None
    return Translated(chat, new, namespaces)


# ---- output ------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class OutputBuilder:
    """Parsed deltas → output items, and the stream's events as they happen."""

    namespaces: dict[str, str]
    encrypted: bool
    items: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _open: dict[str, Any] | None = None  # the item text is being added to
    _kind: str | None = None
    _call_index: int = -1

    def add(self, kind: str, text: str, name: str | None = None, index: int = 0) -> None:
        if kind == "tool_call":
            if index != self._call_index:
                self._close()
                self._call_index = index
                namespace = self.namespaces.get(name or "")
                short = (name or "")[len(namespace) + 1 :] if namespace else (name or "")
                item: dict[str, Any] = {
                    "type": "function_call",
                    "id": _new_id("fc"),
                    "call_id": _new_id("call"),
                    "name": short,
                    "arguments": "",
                    "status": "in_progress",
                }
                if namespace:
                    item["namespace"] = namespace
                self._start(item, "tool_call")
            assert self._open is not None
            self._open["arguments"] += text
            self.events.append(
                (
                    "response.function_call_arguments.delta",
                    {
                        "item_id": self._open["id"],
                        "output_index": len(self.items) - 1,
                        "delta": text,
                    },
                )
            )
            return
        if self._kind != kind:
            self._close()
            if kind == "reasoning":
                self._start(
                    {
                        "type": "reasoning",
                        "id": _new_id("rs"),
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}],
                        "status": "in_progress",
                    },
                    kind,
                )
            else:
                self._start(
                    {
                        "type": "message",
                        "id": _new_id("msg"),
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [],
                    },
                    kind,
                )
                part = {"type": "output_text", "text": "", "annotations": []}
                assert self._open is not None
                self._open["content"].append(part)
                self.events.append(
                    (
                        "response.content_part.added",
                        {
                            "item_id": self._open["id"],
                            "output_index": len(self.items) - 1,
                            "content_index": 0,
                            "part": dict(part),
                        },
                    )
                )
        assert self._open is not None
        index_fields = {
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": text,
        }
        self._open["content"][0]["text"] += text
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        self.events.append((name, index_fields))

    def _start(self, item: dict[str, Any], kind: str) -> None:
        self.items.append(item)
        self._open, self._kind = item, kind
        self.events.append(
            (
                "response.output_item.added",
                {"output_index": len(self.items) - 1, "item": json.loads(json.dumps(item))},
            )
        )

    def _close(self) -> None:
        item, kind = self._open, self._kind
        if item is None:
            return
        index = len(self.items) - 1
        item["status"] = "completed"
        if kind == "tool_call":
            self.events.append(
                (
                    "response.function_call_arguments.done",
                    {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]},
                )
            )
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            self.events.append(
                (
                    "response.reasoning_text.done",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "text": text,
                    },
                )
            )
            if self.encrypted:
                item["encrypted_content"] = encrypt_reasoning(text)
            del item["status"]
        else:
            part = item["content"][0]
            self.events.append(
                (
                    "response.output_text.done",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "text": part["text"],
                    },
                )
            )
            self.events.append(
                (
                    "response.content_part.done",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "part": dict(part),
                    },
                )
            )
        self.events.append(
            (
                "response.output_item.done",
                {"output_index": index, "item": json.loads(json.dumps(item))},
            )
        )
        self._open, self._kind = None, None

    def finish(self) -> None:
        self._close()

    def assistant_messages(self) -> list[dict[str, Any]]:
        """The output as chat messages (what previous_response_id continues from)."""
        out: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for item in self.items:
            if item["type"] == "reasoning":
                reasoning.append(item["content"][0]["text"])
            elif item["type"] == "message":
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": item["content"][0]["text"],
                }
                if reasoning:
                    message["reasoning_content"], reasoning = "\n".join(reasoning), []
                out.append(message)
            else:
                name = (
                    f"{item['namespace']}.{item['name']}" if item.get("namespace") else item["name"]
                )
                call = {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": name, "arguments": item["arguments"]},
                }
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = "\n".join(reasoning), []
                out.append(message)
        return out


class ResponsesService:
    """Runs Responses requests on a `JobBuilder` and a `Responder`, with a `ResponseStore`."""

    def __init__(
        self,
        jobs: JobBuilder,
        responder: Responder,
        store: ResponseStore | SharedResponseStore | None = None,
    ) -> None:
        self.jobs, self.responder = jobs, responder
        self.store = store or ResponseStore()

    async def history(self, req: ResponsesRequest) -> History:
        """The conversation that `previous_response_id` continues, or a new one."""
        if req.previous_response_id is None:
            return History([], _new_id("conv"))
        stored = await self.store.get(req.previous_response_id)
        return History(list(stored.messages), stored.session)

    def prepare(
        self, req: ResponsesRequest, history: History, arrival_s: float
    ) -> tuple[Any, Translated]:
        """(the job, the translation) of a request; renders and tokenizes: off the loop."""
        translated = translate(req, history)
        return self.jobs.chat_job(translated.chat, arrival_s), translated

    def envelope(
        self, req: ResponsesRequest, response_id: str, created: int, status: str
    ) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "model": self.jobs.info.model_name,
            "output": [],
            "instructions": req.instructions,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls
            if req.parallel_tool_calls is not None
            else True,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning,
            "text": req.text or {"format": {"type": "text"}},
            "store": req.store,
            "metadata": req.metadata or {},
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    async def run(
        self, req: ResponsesRequest, job: Any, translated: Translated, history: History
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """The events of one response; the last is ("response.completed", the response)."""
        response_id, created = _new_id("resp"), int(time.time())
        encrypted = ENCRYPTED_REASONING in (req.include or [])
        builder = OutputBuilder(translated.namespaces, encrypted)
        response = self.envelope(req, response_id, created, "in_progress")
        yield "response.created", {"response": json.loads(json.dumps(response))}
        yield "response.in_progress", {"response": json.loads(json.dumps(response))}
        completion = cached = reasoning_tokens = 0
        reason: str | None = None
        choice = self.responder.choice(job, 0)
        try:
            async for d in choice:
                completion += len(d.token_ids)
                reasoning_tokens += d.reasoning_tokens
                cached = d.cached_tokens
                reason = d.finish_reason or reason
                for part in _parts(d):
                    builder.add(*part)
                    for event in builder.events:
                        yield event
                    builder.events.clear()
        finally:
            await choice.aclose()
        builder.finish()
        for event in builder.events:
            yield event
        builder.events.clear()
        response["output"] = builder.items
        response["status"] = "incomplete" if reason == "length" else "completed"
        if reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        prompt = len(job.prompt_ids)
        response["usage"] = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion,
        }
        if req.store:
            messages = history.messages + translated.new_messages + builder.assistant_messages()
            await self.store.save(response_id, Stored(response, messages, history.session))
        yield "response.completed", {"response": response}


def _parts(d: Delta) -> list[tuple[str, str, str | None, int]]:
    """A delta's pieces as (kind, text, name, index): a harmony job's parsed ones, else its
    text as content."""
    if d.parsed is not None:
        return [
            (p.kind, p.text, p.name, p.index) for p in d.parsed if p.text or p.kind == "tool_call"
        ]
    return [("content", d.text, None, 0)] if d.text else []
