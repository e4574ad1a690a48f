"""`lorarl demo`: placeholder; the lead replaces this body with the end-to-end demo."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="run the end-to-end demo (not implemented yet)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # PLACEHOLDER: the lead fills in the demo.
    print("lorarl demo: not implemented yet", file=sys.stderr)
    return 2
