from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from swaserve.cluster.cli import main
from swaserve.cluster.generate import add_arguments, engine_config


def test_generate_prints_one_json_line_per_prompt(
    tiny_model_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=4, hidden_size=32)
    argv = [
        "generate",
        "--model",
        str(model),
        "--prompt",
        "ab",
        "--prompt",
        "cd",
        "--max-new-tokens",
        "5",
    ]
    argv += [
        "--max-total-tokens",
        "256",
        "--page-size",
        "4",
        "--enable-prefix-cache",
        "false",
        "--json",
    ]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [line["prompt"] for line in lines] == ["ab", "cd"]
    assert all(len(line["token_ids"]) <= 5 for line in lines)


def test_generate_compiles_only_when_asked() -> None:
    """A one-off run: `compile` is off unless a flag says otherwise (the default's background
    compile would hold the exit)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_config(parser.parse_args([]), "m").compile is False
    for flag, want in (("auto", "auto"), ("true", True)):
        assert engine_config(parser.parse_args(["--compile", flag]), "m").compile == want


def test_generate_rejects_a_bad_flag_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--enable-prefix-cache", "maybe"])
    assert "expected true or false" in capsys.readouterr().err


def test_serve_fault_flags_reach_the_cluster_config(
    tiny_model_factory: Callable[..., Path],
) -> None:
    import argparse

    from swaserve.cluster.serve_command import add_arguments, build_configs

    model = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=4, hidden_size=32)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults, _ = build_configs(parser.parse_args(["--model", str(model)]))
    assert (defaults.max_attempts, defaults.recreate_lost_workers) == (3, True)
    argv = ["--model", str(model), "--max-attempts", "5", "--no-recreate-lost-workers"]
    config, _ = build_configs(parser.parse_args([*argv, "--recreate-backoff-s", "2.5"]))
    assert (config.max_attempts, config.recreate_lost_workers) == (5, False)
    assert config.recreate_backoff_s == 2.5
    assert defaults.router_resources == {}
    pinned, _ = build_configs(parser.parse_args([*argv, "--router-resources", '{"pool": 0.01}']))
    assert pinned.router_resources == {"pool": 0.01}
    with pytest.raises(SystemExit):  # not JSON
        parser.parse_args([*argv, "--router-resources", "pool"])
    with pytest.raises(ValueError):  # pydantic: at least one attempt
        build_configs(parser.parse_args(["--model", str(model), "--max-attempts", "0"]))


def test_serve_compile_flag(tiny_model_factory: Callable[..., Path]) -> None:
    import argparse

    from swaserve.cluster.serve_command import add_arguments, build_configs

    model = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=4, hidden_size=32)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given = {
        (): "auto",
        ("--compile",): True,
        ("--compile", "false"): False,
        ("--compile", "auto"): "auto",
        ("--compile", "on"): True,
    }
    for flags, want in given.items():
        config, _ = build_configs(parser.parse_args(["--model", str(model), *flags]))
        assert config.engine.compile == want, flags
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", str(model), "--compile", "sometimes"])


def test_every_config_field_is_a_serve_flag(tiny_model_factory: Callable[..., Path]) -> None:
    """The flags are derived from the config models: the fields the old hand-kept list missed
    (tokenizer, seed, schedule_conservativeness, check_on_idle) and a router field added later
    (cache_view) reach the configs."""
    import argparse

    from swaserve.cluster.knobs import ENGINE_FLAGS, ROUTER_FLAGS
    from swaserve.cluster.serve_command import add_arguments, build_configs
    from swaserve.router import RouterConfig
    from swaserve.worker import EngineConfig

    assert set(ENGINE_FLAGS) == set(EngineConfig.model_fields) - {"model"}
    assert set(ROUTER_FLAGS) == set(RouterConfig.model_fields)
    model = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=4, hidden_size=32)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", str(model), "--tokenizer", str(model), "--seed", "7"]
    argv += ["--schedule-conservativeness", "0.5", "--check-on-idle", "false"]
    config, _ = build_configs(parser.parse_args([*argv, "--router-cache-view", "approx"]))
    engine = config.engine
    assert (engine.tokenizer, engine.seed) == (str(model), 7)
    assert (engine.schedule_conservativeness, engine.check_on_idle) == (0.5, False)
    assert config.router.cache_view == "approx"
    with pytest.raises(ValueError):  # pydantic names the choices
        build_configs(parser.parse_args([*argv, "--router-cache-view", "fuzzy"]))


def test_client_flags_build_the_sampling_options(tmp_path: Path) -> None:
    import argparse

    from swaserve.cluster.client import add_arguments, build_request

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    schema = tmp_path / "pet.json"
    schema.write_text('{"type": "object", "required": ["name"]}')
    args = parser.parse_args(
        ["--json-schema", str(schema), "--logprobs", "2", "--presence-penalty", "0.5", "Pet:"]
    )
    params = build_request(args).sampling_params
    assert params.structured_outputs.json_schema == schema.read_text()
    assert (params.logprobs, params.presence_penalty) == (2, 0.5)
    assert not params.HasField("frequency_penalty")
    regex = build_request(parser.parse_args(["--regex", "[0-9]+", "x"])).sampling_params
    assert regex.structured_outputs.WhichOneof("kind") == "regex"
    with pytest.raises(SystemExit):
        parser.parse_args(["--regex", "a", "--json-schema", str(schema)])
