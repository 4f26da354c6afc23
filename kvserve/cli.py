"""The `kvserve` command. Each subcommand's module adds its own parser (``add_parser``)."""

from __future__ import annotations

import argparse
import sys

# Each subcommand's name -> the module that adds its parser.
COMMANDS = {"generate": "kvserve.entrypoints.cli", "serve": "kvserve.entrypoints.serve_cli",
            "bench": "kvserve.bench.cli", "plan": "kvserve.planner.cli", "eval": "kvserve.eval.cli"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``command`` (a subcommand's name) only that subcommand: the
    other modules' imports (the benchmarks, the planner) would add ~0.5 s to a server's start."""
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module in modules:
        __import__(module, fromlist=["add_parser"]).add_parser(sub)  # a broken import must fail loudly
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    args.argv = argv[1:]  # the subcommand's own arguments, for one that starts others with them
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
