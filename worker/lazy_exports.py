"""Package attributes imported on first use (PEP 562), so that importing a light module of a
package (`swaserve.worker.config`, `swaserve.worker.kv.pool_plan`) does not import torch through
the package's `__init__`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `exports` maps an attribute to the module that
    defines it; the first access imports that module and caches the value in the package."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
