"""Command-line flags made from pydantic config fields, so that every knob of `EngineConfig`
and `RouterConfig` has a flag with the field's own description and pydantic validates it."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

ENGINE_FLAGS = (
    "device",
    "dtype",
    "page_size",
    "max_total_tokens",
    "kv_cache_bytes",
    "mem_fraction_static",
    "swa_full_tokens_ratio",
    "expected_seq_len",
    "disable_hybrid_swa_memory",
    "enable_prefix_cache",
    "enable_window_repair",
    "dequantize_weights",
    "compile",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "max_running_requests",
    "max_model_len",
    "swa_eviction_interval",
    "schedule_policy",
    "attention_backend",
    "tp_size",
    "tp_timeout_s",
)


def add_config_flags(
    parser: argparse.ArgumentParser | Any,
    model: type[BaseModel],
    names: Iterable[str],
    *,
    prefix: str = "",
) -> None:
    """One `--<prefix><name>` flag per field (default None: the config's own default)."""
    for name in names:
        field = model.model_fields[name]
        flag = "--" + (prefix + name).replace("_", "-")
        dest = prefix.replace("-", "_") + name
        if field.annotation == bool | typing.Literal["auto"]:  # `--compile` alone: true
            parser.add_argument(
                flag,
                dest=dest,
                type=parse_bool_or_auto,
                nargs="?",
                const=True,
                default=None,
                metavar="true|false|auto",
                help=field.description,
            )
        elif field.annotation is bool:
            parser.add_argument(
                flag,
                dest=dest,
                type=parse_bool,
                default=None,
                metavar="true|false",
                help=field.description,
            )
        else:
            parser.add_argument(
                flag,
                dest=dest,
                type=_parse_value(field.annotation),
                default=None,
                help=field.description,
            )


def config_overrides(
    args: argparse.Namespace, names: Iterable[str], *, prefix: str = ""
) -> dict[str, Any]:
    """The fields whose flags were given."""
    dest_prefix = prefix.replace("-", "_")
    values = {name: getattr(args, dest_prefix + name, None) for name in names}
    return {name: value for name, value in values.items() if value is not None}


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_bool_or_auto(text: str) -> bool | str:
    return "auto" if text.lower() == "auto" else parse_bool(text)


def _parse_value(annotation: object) -> typing.Callable[[str], object]:
    """int / float / str from the field type; pydantic validates the rest."""
    args = typing.get_args(annotation) or (annotation,)

    def parse(text: str) -> object:
        for kind in (int, float):
            if kind in args:
                try:
                    return kind(text)
                except ValueError:
                    continue
        return text

    return parse
