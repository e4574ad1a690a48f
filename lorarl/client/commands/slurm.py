"""`lorarl slurm CONFIG [key=value ...] [-o FILE]`: writes an sbatch script that runs the job on a Slurm
allocation (lorarl/client/launch/slurm.py), and the service configs it reads, under the run folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lorarl.common.config import ConfigError


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("slurm", help="write an sbatch script that runs a job on a Slurm allocation",
                                   description=__doc__)
    parser.add_argument("config", help="the job file")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("-o", "--output", metavar="FILE", help="the script (default: <output.dir>/lorarl.sbatch)")
    parser.add_argument("--partition", default="", help="#SBATCH --partition")
    parser.add_argument("--time", default="", help="#SBATCH --time (e.g. 04:00:00)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lorarl.client.job.config import load_job_config
    from lorarl.client.launch.slurm import write

    try:
        cfg = load_job_config(args.config, list(args.overrides))
        script = Path(args.output) if args.output else Path(cfg.output.dir) / "lorarl.sbatch"
        written = write(cfg, args.config, list(args.overrides), script, partition=args.partition,
                        time_limit=args.time)
    except ConfigError as e:
        print(f"lorarl slurm: bad config: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written[0]} (submit: sbatch {written[0]}) and its service configs in {written[1].parent}")
    return 0
