"""The checks every ingress makes of a request's own fields, before the cluster sees it (the
gRPC service and the OpenAI HTTP API alike): ids, stop strings, message size. A failed check is
a `BadRequest`: INVALID_ARGUMENT over gRPC, 400 over HTTP."""

from __future__ import annotations

import re

from swaserve.proto.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_ID_CHARS = 128
_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]+")


class BadRequest(ValueError):
    """A request field is invalid (INVALID_ARGUMENT)."""


def check_stop_strings(stop: list[str]) -> list[str]:
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"sampling_params.stop: at most {MAX_STOP_STRINGS} stop strings")
    for s in stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise BadRequest(f"sampling_params.stop: each must have 1 to {MAX_STOP_CHARS} chars")
    return list(stop)


def check_id(value: str, what: str) -> str:
    if len(value) > MAX_ID_CHARS or not _ID_PATTERN.fullmatch(value):
        raise BadRequest(
            f"{what} must be 1 to {MAX_ID_CHARS} characters of [A-Za-z0-9._:-], got {value[:40]!r}"
        )
    return value
