"""Subcommands reserved for later issues; each says so and exits 2."""

from __future__ import annotations

import argparse
import sys
from typing import Any

#: Subcommand -> what it will do.
PLANNED = {
    "eval": "evaluate a policy on a task",
    "export": "export an adapter or merged model",
}

NOT_IMPLEMENTED_EXIT = 2


def add_parsers(subparsers: Any) -> None:
    for name, help_text in PLANNED.items():
        parser = subparsers.add_parser(name, help=f"{help_text} (not implemented yet)")
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(handler=not_implemented)


def not_implemented(args: argparse.Namespace) -> int:
    # TODO(later issues): replace with clients.commands.<name>.
    print(f"lorarl {args.command}: not implemented yet", file=sys.stderr)
    return NOT_IMPLEMENTED_EXIT
