"""Regenerate the checked-in gRPC stubs of `swaserve/v1/inference.proto`.

    python proto/generate_stubs.py

runs grpc_tools' protoc with `-I proto/` and writes `inference_pb2.py`, `inference_pb2.pyi` and
`inference_pb2_grpc.py` next to the .proto file. grpc_tools names the message module by its
proto path (`from swaserve.v1 import inference_pb2`), but the stubs install as
`swaserve.proto.swaserve.v1`: the one import is rewritten to a relative one, and the module name
the message classes are built under (their `__module__`, which pickle follows: Ray Serve's gRPC
proxy pickles requests) to the installed one. The stubs are made
with the grpcio-tools version the `test` extra pins; `tests/unit/proto/test_stubs.py` checks that
the checked-in files are what this script makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILE = "swaserve/v1/inference.proto"
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
ABSOLUTE_IMPORT = "from swaserve.v1 import inference_pb2 as "
RELATIVE_IMPORT = "from . import inference_pb2 as "
PROTO_MODULE = "'swaserve.v1.inference_pb2'"
INSTALLED_MODULE = "'swaserve.proto.swaserve.v1.inference_pb2'"


def _rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise RuntimeError(f"expected one {old!r} in {path}")
    path.write_text(text.replace(old, new))


def stub_paths(out_dir: Path) -> list[Path]:
    """Where `generate(out_dir)` writes the stubs: `out_dir/swaserve/v1/inference_pb2*.py[i]`."""
    stem = PROTO_FILE.removesuffix(".proto")
    return [out_dir / f"{stem}{suffix}" for suffix in STUB_SUFFIXES]


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Write the three stub files under `out_dir` (created if missing; existing stubs are
    overwritten) and return their paths. Raises `RuntimeError` when protoc fails or its output
    lacks the one import or module name this rewrites."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_ROOT / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")
    paths = stub_paths(out_dir)
    _rewrite(paths[0], PROTO_MODULE, INSTALLED_MODULE)
    _rewrite(paths[-1], ABSOLUTE_IMPORT, RELATIVE_IMPORT)
    return paths


def main() -> int:
    for path in generate():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
