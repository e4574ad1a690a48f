"""`lorarl jobs --trainer HOST:PORT`: the jobs a trainer holds, one line each — which base, rank, version,
step, buffered trajectories, trained tokens per second of its training passes, and memory (the base counted
once for the jobs sharing it, each job's own)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lorarl.client.calls import client_token
from lorarl.client.commands.run import add_token_file, client_tls
from lorarl.common.config import ConfigError

COLUMNS = ("job", "base", "rank", "version", "step", "buffered", "tokens/s", "share", "waited s", "job memory",
           "base memory (shared by)")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("jobs", help="list a trainer's jobs", description=__doc__)
    parser.add_argument("--trainer", required=True, metavar="HOST:PORT")
    parser.add_argument("--json", action="store_true", help="one JSON object per job instead of a table")
    add_token_file(parser)
    parser.set_defaults(handler=jobs_command)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def rows(jobs: list) -> list[dict[str, Any]]:
    return [{"job": j.job_id, "base": j.config.base_model_path, "rank": j.config.lora.rank, "version": j.version,
             "step": j.step, "buffered": j.buffered_trajectories, "trained_tokens": j.trained_tokens,
             "tokens_per_second": round(j.tokens_per_second, 1), "share": j.config.share or 1.0,
             "base_turns": j.base_turns, "base_wait_seconds": round(j.base_wait_seconds, 1), "job_bytes": j.job_bytes,
             "base_bytes": j.base_bytes, "base_jobs": j.base_jobs} for j in jobs]


def table(found: list[dict[str, Any]]) -> list[str]:
    cells = [COLUMNS] + [(r["job"], r["base"], str(r["rank"]), str(r["version"]), str(r["step"]), str(r["buffered"]),
                          f"{r['tokens_per_second']:,.1f}", f"{r['share']:g}", f"{r['base_wait_seconds']:,.1f}",
                          mib(r["job_bytes"]),
                          f"{mib(r['base_bytes'])} ({r['base_jobs']})") for r in found]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def jobs_command(args: argparse.Namespace) -> int:
    import grpc

    from lorarl.common.channel import sync_channel
    from lorarl.v1 import trainer_pb2, trainer_pb2_grpc

    try:
        token, tls = client_token(args.token_file), client_tls(args)
    except ConfigError as e:
        print(f"lorarl jobs: {e}", file=sys.stderr)
        return 2
    try:
        with sync_channel(args.trainer, token=token, tls=tls) as channel:
            listed = trainer_pb2_grpc.TrainerServiceStub(channel).ListJobs(trainer_pb2.ListJobsRequest(), timeout=30)
    except grpc.RpcError as e:
        print(f"lorarl jobs: the trainer at {args.trainer} answered {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    found = rows(list(listed.jobs))
    if args.json:
        for row in found:
            print(json.dumps(row))
    elif found:
        print("\n".join(table(found)))
    else:
        print(f"no jobs on the trainer at {args.trainer}")
    return 0
