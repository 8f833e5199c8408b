"""Where swaserve keeps what it makes once and reuses across starts: `$SWASERVE_CACHE_DIR`,
else `$XDG_CACHE_HOME/swaserve`, else `~/.cache/swaserve` (the demo model; `inductor/`, the
compiled decode step's caches)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("SWASERVE_CACHE_DIR"):
        return Path(os.environ["SWASERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swaserve"


def compile_cache_dir() -> Path:
    return cache_dir() / "inductor"
