"""Every environment variable swaserve reads, in one module (the README lists them).

| variable | read by | meaning |
|---|---|---|
| `SWASERVE_CACHE_DIR` | `cache_dir` | where the demo model and the compiled decode step's caches live |
| `XDG_CACHE_HOME` | `cache_dir` | its parent when `SWASERVE_CACHE_DIR` is unset (`~/.cache`) |
| `TORCHINDUCTOR_CACHE_DIR` | `inductor_cache_dir` | inductor's own cache dir, when set |
| `SWASERVE_API_KEY` | `api_key` | the HTTP API's key, when no key file is given |
| `SWASERVE_AUTH_TOKEN` | `auth_token` | the gRPC bearer token, when no token file is given |
| `SWASERVE_RAY_NODE_IP_ADDRESS` | `ray_node_ip_address` | `swaserve serve --ray-node-ip-address` |
| `SWASERVE_CPU_AUTO_COMPILE` | `cpu_auto_compile` | `0`: `compile="auto"` stays eager on CPU (no background compile) |
| `PATH` | `prepend_path` | the ninja that builds the C++ CPU kernel is put first |
| `NCCL_*` | `nccl_variables` | checked at TP start for settings that undo NCCL's timeouts |

Each function reads the environment when called (a test or a launcher may set it first).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "SWASERVE_CACHE_DIR"
API_KEY_ENV = "SWASERVE_API_KEY"
AUTH_TOKEN_ENV = "SWASERVE_AUTH_TOKEN"
NODE_IP_ADDRESS_ENV = "SWASERVE_RAY_NODE_IP_ADDRESS"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CPU_AUTO_COMPILE_ENV = "SWASERVE_CPU_AUTO_COMPILE"


def _stripped(name: str) -> str | None:
    return os.environ.get(name, "").strip() or None


def cache_dir() -> Path:
    """`$SWASERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/swaserve`, else `~/.cache/swaserve`."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swaserve"


def inductor_cache_dir(default: Path) -> Path:
    """Inductor's cache dir: `$TORCHINDUCTOR_CACHE_DIR`, which is set to `default` when unset
    (inductor reads the variable itself)."""
    os.environ.setdefault(INDUCTOR_CACHE_ENV, str(default))
    return Path(os.environ[INDUCTOR_CACHE_ENV])


def cpu_auto_compile() -> bool:
    """Whether `compile="auto"` compiles the CPU decode step in the background: unless
    `$SWASERVE_CPU_AUTO_COMPILE` is `0` (the test suite sets it: each of its hundreds of
    engines would otherwise compile beside the others)."""
    return _stripped(CPU_AUTO_COMPILE_ENV) != "0"


def _secret(file: str | None, name: str) -> str | None:
    """The contents of `file` when one is given (a mounted Secret; None if it holds nothing),
    else `$name`."""
    if file:
        return Path(file).read_text().strip() or None
    return _stripped(name)


def api_key(file: str | None = None) -> str | None:
    """The HTTP API key: the contents of `file` if given, else `$SWASERVE_API_KEY`."""
    return _secret(file, API_KEY_ENV)


def auth_token(file: str | None = None) -> str | None:
    """The gRPC bearer token: the contents of `file` if given, else `$SWASERVE_AUTH_TOKEN`."""
    return _secret(file, AUTH_TOKEN_ENV)


def ray_node_ip_address() -> str | None:
    return _stripped(NODE_IP_ADDRESS_ENV)


def prepend_path(directory: str) -> None:
    """Put `directory` first on `$PATH` (once) for the programs this process starts."""
    path = os.environ.get("PATH", "")
    if directory not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([directory, path]) if path else directory


def nccl_variables() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k.startswith("TORCH_NCCL_")
    }
