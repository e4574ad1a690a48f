"""The `lorarl` command line: one subcommand per module in lorarl.client.commands."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from lorarl.client.commands import data, demo, evaluate, jobs, run, serve, slurm, status, stop, tinker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorarl", description="LoRA reinforcement learning for Qwen3 models, as gRPC services."
    )
    parser.add_argument("--version", action="version", version=f"lorarl {installed_version()}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve.add_parser(subcommands)
    run.add_parsers(subcommands)
    evaluate.add_parsers(subcommands)
    demo.add_parser(subcommands)
    data.add_parser(subcommands)
    slurm.add_parser(subcommands)
    jobs.add_parser(subcommands)
    status.add_parser(subcommands)
    stop.add_parser(subcommands)
    tinker.add_parser(subcommands)
    return parser


def installed_version() -> str:
    """The installed distribution's version (pyproject.toml's, as pip recorded it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lorarl")
    except PackageNotFoundError:
        return "unknown (not installed: run `make setup`)"


#: A dotted ``KEY=VALUE`` override, as the subcommands' positional ``overrides`` take them.
_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with ``KEY=VALUE`` overrides accepted anywhere after the config file: argparse
    alone takes positionals only before the first flag (``lorarl run job.yaml --dry-run loop.steps=2``
    would be "unrecognized arguments")."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = getattr(args, "overrides", None)
    strays = [token for token in extra if not _OVERRIDE.match(token)]
    if strays or (extra and not isinstance(overrides, list)):
        parser.error(f"unrecognized arguments: {' '.join(strays or extra)}")
    if extra:
        args.overrides = [*overrides, *extra]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lorarl` console script; returns the process exit code. As the process's own command
    (``argv`` None: the console script, `python -m lorarl.client.cli`) a run a signal stopped leaves at once with
    that code (lorarl.client.interrupt.leave_if_signalled); called with ``argv`` (a test, a program driving lorarl
    in its own process) it always returns."""
    from lorarl.client.interrupt import forget_signals, leave_if_signalled

    forget_signals()  # a signal an earlier command in this process took is not this one's
    args = parse(argv)
    code = int(args.handler(args))
    if argv is None:
        leave_if_signalled(code)  # stopped by SIGTERM or Ctrl-C: its exit code, not the interpreter teardown's
    return code


if __name__ == "__main__":
    sys.exit(main())
