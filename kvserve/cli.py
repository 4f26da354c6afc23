"""The `kvserve` command. Each subcommand's module adds its own parser (``add_parser``)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in ("kvserve.entrypoints.cli", "kvserve.entrypoints.serve_cli", "kvserve.bench.cli",
                   "kvserve.planner.cli", "kvserve.eval.cli"):
        __import__(module, fromlist=["add_parser"]).add_parser(sub)  # a broken import must fail loudly
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # the subcommand's own arguments, for one that starts others with them
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
