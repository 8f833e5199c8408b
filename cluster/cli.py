"""`swaserve` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from swaserve.cluster import client, generate, kv_capacity, serve_command
    from swaserve.worker.models import tiny

    commands = [
        (
            "serve",
            serve_command,
            "serve a model on a Ray cluster of TP worker groups behind the gRPC API",
        ),
        ("client", client, "stream a completion from a running server over gRPC"),
        (
            "kv-capacity",
            kv_capacity,
            "how many concurrent requests fit in a KV budget: one pool vs two pools",
        ),
        (
            "make-tiny-model",
            tiny,
            "write a tiny random GPT-OSS or MiMo-V2-Flash model dir (config, weights, tokenizer)",
        ),
        (
            "generate",
            generate,
            "run the engine offline on a few prompts (default model: a tiny random GPT-OSS)",
        ),
    ]
    parser = argparse.ArgumentParser(prog="swaserve", description="hybrid-SWA inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module, help_text in commands:
        command = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
