"""`lorarl demo`: the default job (examples/demo.yaml) on this machine, end to end.

GRPO with LoRA on the shipped tiny dense Qwen3: the three services start on loopback, vLLM
generates, the trainer trains, adapters travel over a gloo group, and the held-out accuracy is
printed before and after. Extra arguments are dotted overrides, e.g. `lorarl demo loop.steps=10`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEMO_CONFIG = Path(__file__).resolve().parents[3] / "examples" / "demo.yaml"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="run the default job (examples/demo.yaml)", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. loop.steps=10")
    parser.add_argument("--fresh", action="store_true", help="start over even if runs/demo has a checkpoint")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lorarl.client.commands.run import run_command

    args.config, args.dry_run = str(DEMO_CONFIG), False
    return run_command(args)
