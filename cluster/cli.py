"""`swaserve` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="swaserve", description="hybrid-SWA inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser(
        "kv-capacity",
        help="how many concurrent requests fit in a KV budget: single pool vs two pools",
        add_help=False,
    )
    cap.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.command == "kv-capacity":
        from swaserve.worker.kv.capacity_report import main as capacity_main

        return capacity_main(ns.args)
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
