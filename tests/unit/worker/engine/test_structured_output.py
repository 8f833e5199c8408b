"""Grammar-constrained decoding in the engine: random tiny models sampled at temperature 1 give
valid output on every seed; the grammar ends requests with "stop" (or "length", never invalid
output called complete); compiles are cached and run off the step loop; retraction keeps the
matcher right; bad grammars are refused up front."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from swaserve.proto import SamplingParams, StructuredOutputs
from swaserve.worker import Engine, EngineConfig
from swaserve.worker.engine.engine import RequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model_factory: Callable[..., Path]) -> Iterator[Engine]:
    path = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=4)
    e = Engine(EngineConfig(model=str(path), max_total_tokens=4096, check_on_idle=True))
    yield e
    e.shutdown()


def constrained(seed: int, max_new: int = 160, **spec: object) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=1.0,
        seed=seed,
        structured_outputs=StructuredOutputs(**spec),  # type: ignore[arg-type]
    )


def test_json_schema_output_validates_on_every_seed(engine: Engine) -> None:
    seeds = range(24)
    outs = engine.generate(
        ["Describe a pet:"] * len(seeds), [constrained(s, json_schema=SCHEMA) for s in seeds]
    )
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 12  # sampled, not one forced answer
    engine.check()


def test_constrained_and_free_rows_share_batches(engine: Engine) -> None:
    """Half the batch constrained: the free rows draw exactly what they draw alone."""
    free = [SamplingParams(max_new_tokens=30, temperature=1.0, seed=s) for s in range(4)]
    alone = engine.generate(["x"] * 4, free)
    mixed = engine.generate(
        ["x"] * 8, [p for s in range(4) for p in (free[s], constrained(s, json_schema=SCHEMA))]
    )
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]
    for out in mixed[1::2]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize(
    ("spec", "valid"),
    [
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"regex": r"[a-c]{2,4}-\d{3}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d{3}", t)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        (
            {"grammar": 'start: item ("," item)*\nitem: "(" /[0-9]/ ")"'},
            lambda t: re.fullmatch(r"\([0-9]\)(,\([0-9]\))*", t),
        ),
    ],
)
def test_each_grammar_kind_constrains_the_output(
    engine: Engine, spec: dict[str, object], valid: Callable[[str], object]
) -> None:
    outs = engine.generate(["go"] * 8, [constrained(s, max_new=60, **spec) for s in range(8)])
    for out in outs:
        if out.finish_reason == "stop":
            assert valid(out.text), out.text
        else:  # an open object or list may go on past max_new_tokens: cut, and said so
            assert out.finish_reason == "length" and ("grammar" in spec or "json_object" in spec)
    assert any(o.finish_reason == "stop" for o in outs)


def test_a_grammar_that_cannot_end_within_max_tokens_finishes_with_length(engine: Engine) -> None:
    params = constrained(0, max_new=5, regex=r"[a-z]{10}")
    (out,) = engine.generate(["go"], params)
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert re.fullmatch(r"[a-z]{5}", out.text)


def test_a_complete_constrained_output_ends_below_min_tokens(engine: Engine) -> None:
    """`min_tokens` forbids the stop ids, but a grammar whose output is complete ends the
    request there, as a stop; a row without a grammar keeps `min_tokens`."""
    done = SamplingParams(
        max_new_tokens=30,
        temperature=0.0,
        min_tokens=24,
        structured_outputs=StructuredOutputs(json_schema={"type": "string", "maxLength": 3}),
    )
    open_ended = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, min_tokens=12)
    sampled = done.model_copy(update={"temperature": 1.0, "seed": 5})
    short, drawn, free = engine.generate(["go"] * 3, [done, sampled, open_ended])
    assert drawn.finish_reason == "stop" and len(json.loads(drawn.text)) <= 3
    assert short.finish_reason == "stop", short
    assert len(json.loads(short.text)) <= 3 and len(short.token_ids) < 24
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    engine.check()


def test_a_vanishing_temperature_or_repetition_penalty_never_overflows(engine: Engine) -> None:
    """Found by the API fuzz (`bench/api_fuzz.py`): a temperature of 1e-32 divided float32
    logits into infinities and drew token 0, which the request's grammar refused (an internal
    error); a repetition penalty of 1e-32 did the same. Below 1e-5 a temperature is greedy;
    the penalty is at least 0.01."""
    schema = StructuredOutputs(json_schema={"type": "string", "maxLength": 3})
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, structured_outputs=schema)
    tiny = greedy.model_copy(update={"temperature": 1e-32, "seed": 5})
    assert tiny.greedy and SamplingParams(temperature=1e-5).greedy is False
    (reference,) = engine.generate(["go"], [greedy])
    (out,) = engine.generate(["go"], [tiny])
    assert out.token_ids == reference.token_ids
    strong = SamplingParams(
        max_new_tokens=6,
        temperature=2e-5,
        seed=5,
        repetition_penalty=0.01,
        structured_outputs=schema,
    )
    (out,) = engine.generate(["go go go"], [strong])  # no internal error: tokens it allows
    assert out.finish_reason in ("stop", "length") and out.text.startswith('"')
    with pytest.raises(ValidationError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-32)
    engine.check()


def test_stop_strings_and_grammar_end_together(engine: Engine) -> None:
    params = SamplingParams(
        max_new_tokens=40,
        temperature=1.0,
        seed=1,
        stop=("b",),
        structured_outputs=StructuredOutputs(regex="a{3}b[a-z]{20}"),
    )
    (out,) = engine.generate(["go"], params)
    assert out.finish_reason == "stop" and out.text == "aaa"
    assert out.token_ids == [ord("a")] * 3 + [ord("b")]


def test_one_compile_per_grammar_and_a_slow_compile_stalls_no_other_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = engine.grammar
    before = compiler.compiled
    engine.generate(["a", "b"], [constrained(s, json_schema=SCHEMA) for s in (100, 101)])
    assert compiler.compiled == before  # compiled by an earlier test: cached
    release = threading.Event()
    slow_compile = compiler._compile

    def held(spec: StructuredOutputs):  # type: ignore[no-untyped-def]
        release.wait(timeout=60)
        return slow_compile(spec)

    monkeypatch.setattr(compiler, "_compile", held)
    slow = engine.add_request("q", constrained(0, regex="[0-9]{3}"))
    free = engine.add_request("q", SamplingParams(max_new_tokens=8, temperature=0))
    done: set[str] = set()
    while free not in done:
        done |= {o.request_id for o in engine.step() if o.finished}
    assert slow not in done and engine.has_unfinished_requests()  # still compiling
    release.set()
    while slow not in done:
        done |= {o.request_id for o in engine.step() if o.finished}
    assert compiler.compiled == before + 1
    engine.check()


def test_aborting_a_request_while_its_grammar_compiles(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    compiler = engine.grammar
    slow_compile = compiler._compile
    monkeypatch.setattr(
        compiler, "_compile", lambda spec: (release.wait(60), slow_compile(spec))[1]
    )
    rid = engine.add_request("q", constrained(0, regex="[0-9]{4}"))
    assert engine.abort(rid)
    assert not engine.has_unfinished_requests()
    release.set()
    engine.check()


def test_retraction_keeps_each_matcher_right(tiny_model_factory: Callable[..., Path]) -> None:
    """Pools so small that decodes are retracted and re-prefilled: every output still
    validates (the matcher advanced once per kept token)."""
    path = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=4)
    engine = Engine(
        EngineConfig(
            model=str(path),
            max_total_tokens=448,
            schedule_conservativeness=0.1,
            max_running_requests=12,
            chunked_prefill_size=32,
        )
    )
    try:
        prompts = [list(range(1, 40 + 3 * i)) for i in range(12)]
        outs = engine.generate(prompts, [constrained(s, json_schema=SCHEMA) for s in range(12)])
        assert engine.stats.retractions > 0
        for out in outs:
            assert out.finish_reason in ("stop", "length")
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), SCHEMA)
        engine.check()
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"regex": "[a-"}, "regex"),
        ({"grammar": "start: missing_rule"}, "missing_rule"),
        ({"json_schema": {"type": "nonsense"}}, "nonsense"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_naming_why(
    engine: Engine, spec: dict[str, object], message: str
) -> None:
    with pytest.raises(RequestError, match=message):
        engine.add_request("q", constrained(0, **spec))
    assert not engine.has_unfinished_requests()


def test_bad_sampling_options_are_refused() -> None:
    with pytest.raises(ValidationError, match="over the limit"):
        StructuredOutputs(json_schema={"description": "x" * 1_000_000})
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValidationError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValidationError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValidationError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=-3)
    with pytest.raises(ValidationError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    assert SamplingParams(logit_bias={3: 500.0}).logit_bias == {3: 100.0}  # clamped


def test_token_ids_outside_the_vocabulary_are_refused(engine: Engine) -> None:
    vocab = engine.model_config.vocab_size
    with pytest.raises(RequestError, match=f"logit_bias: token id {vocab}"):
        engine.add_request("q", SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished_requests()


def test_compiler_caches_by_grammar_not_by_spelling() -> None:
    a = StructuredOutputs(json_schema={"type": "object", "required": ["a"]})
    b = StructuredOutputs(json_schema='{"required": ["a"], "type": "object"}')
    assert a.key == b.key


def test_processing_traffic_per_step_does_not_grow_with_the_sequence(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a processed decode step sends to the device (bitmask rows, bias, penalty
    parameters) is the same at its 5th and its 60th token: the penalty counters stay on the
    device, built once per request from its tokens so far."""
    import swaserve.worker.engine.engine as engine_module
    import swaserve.worker.runner.logits as logits_module

    sent: list[int] = []
    built: list[int] = []

    def recording(real):  # type: ignore[no-untyped-def]
        def to_device(t, device):  # type: ignore[no-untyped-def]
            if t.device.type == "cpu":
                sent.append(t.numel() * t.element_size())
            return real(t, device)

        return to_device

    real_of = logits_module.PenaltyState.of

    def counting_of(row, resumed, vocab, device):  # type: ignore[no-untyped-def]
        built.append(len(row.output_ids))
        return real_of(row, resumed, vocab, device)

    for module in (engine_module, logits_module):
        monkeypatch.setattr(module, "to_device", recording(module.to_device))
    monkeypatch.setattr(logits_module.PenaltyState, "of", staticmethod(counting_of))
    params = SamplingParams(
        max_new_tokens=64,
        temperature=1.0,
        seed=0,
        ignore_eos=True,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={5: 1.0},
        logprobs=2,
        structured_outputs=StructuredOutputs(regex="[a-z]{200}"),
    )
    per_step = []
    rid = engine.add_request(list(range(1, 30)), params)
    while engine.has_unfinished_requests():
        sent.clear()
        engine.step()
        per_step.append(sum(sent))
    assert built == [0]  # one penalty state, at its first draw
    decode = per_step[-60:]
    assert len(set(decode[4:])) == 1, decode  # the same bytes at every decode step
    assert rid not in engine._requests


def test_a_migrated_request_continues_its_grammar_and_counts_its_tokens(engine: Engine) -> None:
    """`resumed_tokens`: the prompt's last tokens were generated on another worker; the
    grammar continues after them, penalties and min_tokens count them as output."""
    params = constrained(3, max_new=8, regex="ab[0-9]{3}")
    rid = engine.add_request([1, 2, 3, ord("a"), ord("b")], params, resumed_tokens=2)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason
    assert reason == "stop" and len(tokens) == 3 and all(chr(t).isdigit() for t in tokens), tokens
    with pytest.raises(RequestError, match="resumed_tokens"):
        engine.add_request([1, 2], params, resumed_tokens=2)
    assert rid not in engine._requests
    engine.check()


def test_a_grammar_that_breaks_or_compiles_too_long_ends_only_its_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llguidance bounds its work (fuel): a matcher that runs out mid-generation ends its
    request with "error" and the reason; a compile past GRAMMAR_TIMEOUT_S likewise. The
    other requests go on."""
    import swaserve.worker.engine.engine as engine_module
    from swaserve.worker.engine.grammar import GrammarMatcher

    calls = {"n": 0}

    def error(self: GrammarMatcher) -> str:
        calls["n"] += 1
        return "lexer fuel exhausted" if calls["n"] > 3 else ""

    with monkeypatch.context() as patch:
        patch.setattr(GrammarMatcher, "error", property(error))
        broken = engine.add_request("q", constrained(0, regex="[a-z]{30}"))
        free = engine.add_request("q", SamplingParams(max_new_tokens=12, temperature=0))
        ends = {}
        while engine.has_unfinished_requests():
            ends |= {o.request_id: (o.finish_reason, o.error) for o in engine.step() if o.finished}
    assert ends[broken] == ("error", "structured output: lexer fuel exhausted")
    assert ends[free] == ("length", None)
    engine.check()

    release = threading.Event()
    compiler = engine.grammar
    slow_compile = compiler._compile
    monkeypatch.setattr(
        compiler, "_compile", lambda spec: (release.wait(60), slow_compile(spec))[1]
    )
    monkeypatch.setattr(engine_module, "GRAMMAR_TIMEOUT_S", 0.0)
    late = engine.add_request("q", constrained(0, regex="[0-9]{5}"))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(late, "error")]
    assert "not compiled within" in (outs[0].error or "")
    release.set()
    engine.check()
