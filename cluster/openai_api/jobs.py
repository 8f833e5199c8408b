"""A request's job: a validated request body turned into what its choices share (prompt ids,
`SamplingParams`, stop strings, session key), or an `APIError` naming the field at fault.

    prompt ids (text: tokenizer, with BOS; messages: the chat template, which places BOS itself;
    ids: as given)  →  max_tokens against `ModelInfo.limits`  →  SamplingParams  →
    `RoutedCluster.check_request`

`JobBuilder` tokenizes and renders templates: the routes call it off the event loop, so one huge
prompt does not stall the other streams.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from swaserve.cluster.model_info import ModelInfo
from swaserve.cluster.openai_api import chat
from swaserve.cluster.openai_api.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ID_PREFIXES,
    APIError,
    BaseGenerateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    message_text,
)
from swaserve.cluster.request_checks import MAX_ID_CHARS, BadRequest, check_id, check_stop_strings
from swaserve.cluster.routed import InvalidRequest, RoutedCluster
from swaserve.proto.grammar import check_grammar
from swaserve.proto.sampling_params import SamplingParams, StructuredOutputs
from swaserve.proto.text.chat_template import ChatTemplate, ChatTemplateError
from swaserve.proto.text.formats import HARMONY, ChatFormat, chat_format
from swaserve.proto.text.tokenizer import encode_text


@dataclass(slots=True)
class Job:
    """One validated request: what every choice shares."""

    kind: str  # "text_completion" | "chat.completion"
    response_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    session_id: str | None
    n: int
    include_usage: bool
    return_token_ids: bool
    arrival_s: float
    format: ChatFormat | None = None  # the output is in this chat format: parse it
    tools: dict[str, Any] | None = None  # function name -> parameters schema (for the parser)

    def request_id(self, index: int) -> str:
        return self.response_id if self.n == 1 else f"{self.response_id}-{index}"


class JobBuilder:
    """Makes the `Job` of a completion or chat request for the cluster's model (once
    `cluster.ready()` returned). Not a coroutine: it tokenizes."""

    def __init__(self, cluster: RoutedCluster) -> None:
        self.cluster = cluster
        self._template: ChatTemplate | None = None

    @property
    def info(self) -> ModelInfo:
        info = self.cluster.model_info
        assert info is not None, "await cluster.ready() first"
        return info

    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_model_dir(self.info.model_path)
        return self._template

    @property
    def format(self) -> ChatFormat | None:
        """The chat format the model speaks (harmony, MiMo's), else None: plain text."""
        return chat_format(self.cluster.tokenizer)

    def completion_job(self, req: CompletionRequest, arrival_s: float) -> Job:
        self._check_common(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > 1:
                raise APIError(400, "one prompt per request (no batches)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.cluster.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            ids = self.cluster.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
        return self._job("text_completion", req, ids, arrival_s, "prompt", req.max_tokens)

    def chat_job(self, req: ChatCompletionRequest, arrival_s: float) -> Job:
        self._check_common(req)
        tokenizer = self.cluster.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        both = (req.max_tokens, req.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise APIError(400, "max_tokens and max_completion_tokens differ", param="max_tokens")
        max_field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = (
            req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        )
        if self.format is not None:
            return self._parsed_job(req, self.format, arrival_s, max_tokens, max_field)
        for name in ("tools", "reasoning_effort"):
            if getattr(req, name):
                raise APIError(
                    400,
                    f"{name}: this model's chat template has no tool calls or reasoning parser yet",
                    param=name,
                    code="unsupported_parameter",
                )
        for i, m in enumerate(req.messages):
            if m.role == "tool" or m.tool_calls:
                raise APIError(
                    400,
                    "tool calls need a model whose output swaserve parses for them",
                    param=f"messages[{i}].role",
                )
        messages = [
            {"role": m.role, "content": message_text(m.content, i), "name": m.name}
            for i, m in enumerate(req.messages)
        ]
        try:
            text = self.template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        # The template places BOS itself: encode without adding it again.
        ids = encode_text(tokenizer.tokenizer, text)
        return self._job("chat.completion", req, ids, arrival_s, "messages", max_tokens, max_field)

    def _parsed_job(
        self,
        req: ChatCompletionRequest,
        fmt: ChatFormat,
        arrival_s: float,
        max_tokens: int | None,
        max_field: str,
    ) -> Job:
        """A chat for a model whose format swaserve parses: the prompt rendered (harmony: by
        `proto.text.harmony`; MiMo: by the checkpoint's template, with its tools and thinking
        switch), generation stopped at the format's end tokens, the output parsed
        (`Job.format`). A forced tool call or a structured answer is a grammar over the
        format's own syntax."""
        assert self.cluster.tokenizer is not None
        choice = chat.tool_choice(req)
        if fmt.name == HARMONY:
            text = chat.conversation(req, choice).render()
            grammar = chat.forced_call_grammar(req, choice)
        else:
            thinking = chat.mimo_thinking(req)
            try:
                text = self.template.render(
                    chat.mimo_messages(req),
                    add_generation_prompt=True,
                    tools=None if choice.mode == "none" else chat.tool_dicts(req),
                    **{**(req.chat_template_kwargs or {}), "enable_thinking": thinking},
                )
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), param="messages") from None
            grammar = chat.mimo_forced_call_grammar(req, choice, thinking)
        source = "tools"
        constrained = structured_outputs(req)
        if constrained is not None:
            if grammar is not None:
                raise APIError(
                    400,
                    f"a forced tool call and {constrained[0]} exclude each other",
                    param="tool_choice",
                )
            source = constrained[0]
            if fmt.name == HARMONY:
                grammar = chat.final_answer_grammar(source, constrained[1])
            else:
                grammar = chat.mimo_final_answer_grammar(source, constrained[1], thinking)
        structured = None if grammar is None else (source, {"grammar": grammar})
        # the format's end tokens (GPT-OSS: <|return|>, <|call|>; MiMo: <|im_end|>) are its EOS
        stops = () if req.ignore_eos else fmt.stop_ids
        ids = encode_text(self.cluster.tokenizer.tokenizer, text)
        job = self._job(
            "chat.completion",
            req,
            ids,
            arrival_s,
            "messages",
            max_tokens,
            max_field,
            structured=structured,
            stop_ids=stops,
        )
        job.format = fmt
        job.tools = {t.function.name: t.function.parameters or {} for t in req.tools or ()}
        return job

    def _check_common(self, req: BaseGenerateRequest) -> None:
        name = self.info.model_name
        if req.model is not None and req.model != name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        limits = self.cluster.limits
        refused = limits.n_refusal(req.n)
        if refused is not None:
            raise APIError(400, refused, param="n")
        tools = getattr(req, "tools", None) or []
        refused = limits.tools_refusal(
            [json.dumps(t.function.parameters or {}, ensure_ascii=False) for t in tools]
        )
        if refused is not None:
            raise APIError(400, refused, param="tools")

    def _job(
        self,
        kind: str,
        req: BaseGenerateRequest,
        ids: list[int],
        arrival_s: float,
        prompt_field: str,
        max_tokens: int | None,
        max_tokens_field: str = "max_tokens",
        *,
        structured: tuple[str, dict[str, Any]] | bool | None = True,
        stop_ids: tuple[int, ...] = (),
    ) -> Job:
        """The job of a request whose prompt is `ids`; checks the lengths and the sampling
        parameters (a bad one is a 400 naming its field). `structured`: (the field it came
        from, `StructuredOutputs` fields), None for none, True for the request's own
        (`structured_outputs(req)`); `stop_ids`: stop ids the model's format adds."""
        default = DEFAULT_COMPLETION_MAX_TOKENS if kind == "text_completion" else None
        max_new = self._max_new_tokens(ids, max_tokens, default, prompt_field, max_tokens_field)
        if structured is True:
            structured = structured_outputs(req)
        params = self._sampling_params(req, max_new, max_tokens_field, structured or None, stop_ids)
        try:
            self.cluster.check_request(ids, params, max_new_name=max_tokens_field)
        except InvalidRequest as exc:
            param = {
                None: prompt_field,
                "prompt": prompt_field,
                "structured_outputs": structured[0] if isinstance(structured, tuple) else None,
            }.get(exc.field, exc.field)
            raise APIError(400, str(exc), param=param) from None
        return Job(
            kind=kind,
            response_id=f"{ID_PREFIXES[kind]}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.info.model_name,
            prompt_ids=ids,
            params=params,
            stop=list(params.stop),
            session_id=self._session(req),
            n=req.n,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            return_token_ids=req.return_token_ids,
            arrival_s=arrival_s,
        )

    def _max_new_tokens(
        self, ids: list[int], asked: int | None, default: int | None, prompt: str, field: str
    ) -> int:
        """`asked`, or the default (None: all the room) clipped to the room the prompt leaves
        (requests are refused up front, never cut short). A request over a limit is a 400
        naming the prompt or `field`, whichever the limit blames."""
        limits = self.info.limits
        if asked is None:
            room = self.cluster.limits.default_max_tokens(limits.max_new_tokens_room(len(ids)))
            asked = max(1, room if default is None else min(default, room))
        refused = limits.check(len(ids), asked, max_new_name=field)
        if refused is not None:
            raise APIError(
                400, refused.message, param=prompt if refused.field == "prompt" else field
            )
        return asked

    def _sampling_params(
        self,
        req: BaseGenerateRequest,
        max_new: int,
        max_tokens_field: str,
        structured: tuple[str, dict[str, Any]] | None,
        stop_ids: tuple[int, ...],
    ) -> SamplingParams:
        values: dict[str, Any] = {"max_new_tokens": max_new, "ignore_eos": req.ignore_eos}
        names = (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_tokens",
            "num_speculative_tokens",
        )
        for name in names:
            if getattr(req, name) is not None:
                values[name] = getattr(req, name)
        if req.logit_bias:
            values["logit_bias"] = self._logit_bias(req.logit_bias)
        logprobs = self._logprobs(req)
        if logprobs is not None:
            values["logprobs"] = logprobs
        if structured is not None:
            source, spec = structured
            try:
                values["structured_outputs"] = spec = StructuredOutputs(**spec)
                check_grammar(spec)
            except ValueError as exc:  # ValidationError and GrammarError
                raise APIError(400, f"{source}: {_reason(exc)}", param=source) from None
        stop = self._stop(req.stop)
        if stop:
            values["stop"] = tuple(stop)
        if req.stop_token_ids:
            bad = [t for t in req.stop_token_ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"stop_token_ids: {bad[0]} is outside [0, {self.info.vocab_size})",
                    param="stop_token_ids",
                )
        if req.stop_token_ids or stop_ids:
            values["stop_token_ids"] = tuple(
                dict.fromkeys((*(req.stop_token_ids or ()), *stop_ids))
            )
        try:
            return SamplingParams(**values)
        except ValidationError as exc:
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "sampling parameters"
            name = max_tokens_field if name == "max_new_tokens" else name
            name = "top_logprobs" if name == "logprobs" and isinstance(req.logprobs, bool) else name
            raise APIError(400, f"{name}: {first['msg']}", param=name) from None

    def _logit_bias(self, bias: dict[str, float]) -> dict[int, float]:
        """OpenAI's `logit_bias` (token ids as JSON object keys) with int keys; a key that is
        not a token id of this model is a 400 naming it."""
        vocab = self.info.vocab_size
        out = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < vocab or str(token) != key.strip():
                raise APIError(
                    400,
                    f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})",
                    param="logit_bias",
                )
            out[token] = value
        return out

    def _logprobs(self, req: BaseGenerateRequest) -> int | None:
        """`SamplingParams.logprobs`: chat's `logprobs` (bool) with `top_logprobs`, or the
        completions API's `logprobs` (int)."""
        if isinstance(req, ChatCompletionRequest):
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return (req.top_logprobs or 0) if req.logprobs else None
        if isinstance(req, CompletionRequest):
            return req.logprobs
        return None

    def _stop(self, stop: Any) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise APIError(400, "stop must be a string or a list of strings", param="stop")
        try:
            checked = check_stop_strings(stops)
        except BadRequest as exc:
            raise APIError(400, str(exc).replace("sampling_params.", ""), param="stop") from None
        if checked and self.cluster.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer: use stop_token_ids", param="stop")
        return checked

    def _session(self, req: BaseGenerateRequest) -> str | None:
        """The router's session key: `session_id` (checked as gRPC checks it), else
        `prompt_cache_key` or `user` (hashed when not a valid id, e.g. an e-mail address)."""
        if req.session_id is not None:
            try:
                return check_id(req.session_id, "session_id")
            except BadRequest as exc:
                raise APIError(400, str(exc), param="session_id") from None
        key = req.prompt_cache_key or req.user
        if not key:
            return None
        try:
            return check_id(key, "user")
        except BadRequest:
            return "user-" + hashlib.sha256(key.encode()).hexdigest()[: MAX_ID_CHARS // 4]


GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's earlier request fields for structured output → `StructuredOutputs` kinds."""

VLLM_NAMES = {"json": "json_schema"}
"""vLLM's `structured_outputs` keys that `StructuredOutputs` spells otherwise."""


def structured_outputs(req: BaseGenerateRequest) -> tuple[str, dict[str, Any]] | None:
    """(the field it came from, `StructuredOutputs` fields) of the one way the request
    constrains its output: `response_format` (chat), vLLM's `structured_outputs`, or its
    earlier `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; None when it
    does not. Two at once are a 400."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(
                    400,
                    "response_format: json_schema.schema is required for type json_schema",
                    param="response_format",
                )
            found.append(("response_format", {"json_schema": fmt.json_schema.schema_}))
    if req.structured_outputs:
        spec = {VLLM_NAMES.get(k, k): v for k, v in req.structured_outputs.items()}
        found.append(("structured_outputs", spec))
    for field_name, kind in GUIDED.items():
        value = getattr(req, field_name)
        if value is not None:
            found.append((field_name, {kind: value}))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"constrain the output one way only, not {names}", param=found[1][0])
    return found[0] if found else None


def _reason(exc: ValueError) -> str:
    """A pydantic or grammar error as one line."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(exc)
