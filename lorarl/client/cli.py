"""The `lorarl` command line: one subcommand per module in lorarl.client.commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lorarl.client.commands import demo, evaluate, run, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorarl", description="LoRA reinforcement learning for Qwen3 models, as gRPC services."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve.add_parser(subcommands)
    run.add_parsers(subcommands)
    evaluate.add_parsers(subcommands)
    demo.add_parser(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lorarl` console script; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
