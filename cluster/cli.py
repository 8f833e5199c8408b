"""`swaserve` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from swaserve.cluster import generate
    from swaserve.worker.kv import capacity
    from swaserve.worker.models import tiny

    parser = argparse.ArgumentParser(prog="swaserve", description="hybrid-SWA inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser(
        "kv-capacity",
        help="how many concurrent requests fit in a KV budget: one pool vs two pools",
        description=capacity.__doc__,
    )
    capacity.add_arguments(cap)
    cap.set_defaults(run=capacity.run)
    tiny_model = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random GPT-OSS or MiMo-V2-Flash model dir (config, weights, tokenizer)",
        description=tiny.__doc__,
    )
    tiny.add_arguments(tiny_model)
    tiny_model.set_defaults(run=tiny.run)
    gen = sub.add_parser(
        "generate",
        help="run the engine offline on a few prompts (default model: a tiny random GPT-OSS)",
        description=generate.__doc__,
    )
    generate.add_arguments(gen)
    gen.set_defaults(run=generate.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
