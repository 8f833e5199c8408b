"""One home for the knobs: `EngineConfig`, `RouterConfig` and `IngressLimits` are the source of
every knob, and the command-line flags (`swaserve serve`, `swaserve generate`), the Serve app's
arguments (`ServeAppArgs.check_extra`) and the Helm chart's `engine` / `router` / `limits`
values (their schema: `helm_values_schema`) are derived from their fields, with the fields' own
descriptions; pydantic validates them all. `python -m swaserve.cluster.knobs` rewrites the chart's schema sections."""

from __future__ import annotations

import argparse
import json
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from swaserve.cluster.ingress_limits import IngressLimits
from swaserve.router.config import RouterConfig
from swaserve.worker.config import EngineConfig

ENGINE_FLAGS = tuple(name for name in EngineConfig.model_fields if name != "model")
"""Every engine knob but `model`, which each command gives its own flag (with its default)."""
ROUTER_FLAGS = tuple(RouterConfig.model_fields)
LIMIT_FLAGS = tuple(IngressLimits.model_fields)
"""`--limit-<name>`, Serve's `limit_<name>`, Helm's `limits.<name>`."""
HELM_ENGINE_VALUES = tuple(name for name in ENGINE_FLAGS if name not in ("tp_size", "device"))
"""The chart's `engine` values: `tp_size` is `tensorParallelSize`, `device` follows the mode."""
HELM_SCHEMA = Path(__file__).resolve().parents[1] / "helm" / "swaserve" / "values.schema.json"


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


def helm_values_schema(model: type[BaseModel], names: Iterable[str]) -> dict[str, Any]:
    """The JSON schema of a chart values section holding `names` of `model`: each value is
    what the field accepts (pydantic's own schema of it: types, bounds, choices) or null (the
    config's default)."""
    fields = model.model_json_schema()["properties"]
    properties: dict[str, Any] = {}
    for name in names:
        field = {k: v for k, v in fields[name].items() if k not in ("title", "default")}
        description = field.pop("description", None)
        options = field.pop("anyOf", None)
        if options is None:  # one type: its keywords are the option
            options, field = [field], {}
        options = [o for o in options if o != {"type": "null"}]
        # Keywords beside anyOf (a number's range on `float | "auto"`) apply to every option.
        properties[name] = {**field, "anyOf": [*options, {"type": "null"}]}
        if description:
            properties[name]["description"] = description
    return {"type": "object", "additionalProperties": False, "properties": properties}


def write_helm_schema(path: Path = HELM_SCHEMA) -> None:
    """Rewrite the `engine`, `router` and `limits` sections of the chart's values schema."""
    schema = json.loads(path.read_text())
    schema["properties"]["engine"] = helm_values_schema(EngineConfig, HELM_ENGINE_VALUES)
    schema["properties"]["router"] = helm_values_schema(RouterConfig, ROUTER_FLAGS)
    schema["properties"]["limits"] = helm_values_schema(IngressLimits, LIMIT_FLAGS)
    path.write_text(json.dumps(schema, indent=2) + "\n")


if __name__ == "__main__":
    write_helm_schema()
