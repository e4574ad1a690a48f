"""`lorarl stop RUN_DIR`: stops the `lorarl run` whose output dir is RUN_DIR as Ctrl-C would: its services
stop, and the run resumes from its last resume point when started again.

The launcher records itself in RUN_DIR/services/launcher.json while it runs (pid and start time); it gets
SIGTERM, and the command waits for it to exit. `lorarl run A.yaml B.yaml` records itself in every job's
directory, so stopping one stops them all (they share the services).

exit status:
  0  stopped, or nothing to stop: no launcher recorded, or a stale record (its process is gone, or its
     pid now names another process: the record is removed)
  1  the launcher did not exit within --timeout (with --kill it is then SIGKILLed: its services leave on
     their own within seconds), or may not be signalled (another user's)
  2  RUN_DIR is not a run directory
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lorarl.client.launch.launcher_record import LauncherRecord, read_record, record_path
from lorarl.client.launch.run_dir import run_dir_problem

POLL_S = 0.2
DEFAULT_TIMEOUT_S = 60.0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("stop", help="stop the `lorarl run` of a run directory (as Ctrl-C does)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the job's output.dir, e.g. runs/demo")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"seconds to wait for the launcher to stop its services and exit (default "
                             f"{DEFAULT_TIMEOUT_S:.0f})")
    parser.add_argument("--kill", action="store_true", help="SIGKILL the launcher if it has not exited by then")
    parser.set_defaults(handler=stop_command)


def say(message: str) -> None:
    print(f"lorarl stop: {message}", flush=True)


def stop_command(args: argparse.Namespace) -> int:
    if problem := run_dir_problem(args.run_dir):
        print(f"lorarl stop: {problem}", file=sys.stderr)
        return 2
    services = Path(args.run_dir) / "services"
    try:
        record = read_record(services)
    except ValueError as e:
        print(f"lorarl stop: {e}; remove it if no `lorarl run` writes to {args.run_dir}", file=sys.stderr)
        return 1
    if record is None:
        say(f"nothing to stop: no `lorarl run` is recorded as running in {args.run_dir} ({record_path(services)} "
            "is absent)")
        return 0
    liveness = record.liveness()
    if liveness != "running":
        why = "is gone" if liveness == "gone" else "now names another process (started later)"
        record_path(services).unlink(missing_ok=True)
        say(f"nothing to stop: the recorded launcher ({record.describe()}) {why}; removed its stale record")
        return 0
    return terminate(record, args.timeout, args.kill)


def terminate(record: LauncherRecord, timeout_s: float, kill: bool) -> int:
    """SIGTERM to the launcher (it stops its services, as on Ctrl-C), then waits up to ``timeout_s`` for it to
    exit; SIGKILL after that with ``kill``."""
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        say(f"stopped: the launcher ({record.describe()}) exited on its own")
        return 0
    except PermissionError:
        print(f"lorarl stop: may not signal the launcher ({record.describe()}): it is another user's process",
              file=sys.stderr)
        return 1
    say(f"stopping {record.describe()}: SIGTERM sent, waiting up to {timeout_s:g} s for its services to stop")
    started = time.monotonic()
    if _exits(record, timeout_s):
        say(f"stopped in {time.monotonic() - started:.1f} s; run the same `lorarl run` command again to resume")
        return 0
    if not kill:
        print(f"lorarl stop: the launcher (pid {record.pid}) is still running after {timeout_s:g} s; wait longer "
              f"(--timeout), or pass --kill", file=sys.stderr)
        return 1
    os.kill(record.pid, signal.SIGKILL)
    if _exits(record, 10.0):
        say(f"killed pid {record.pid} after {timeout_s:g} s; its services leave on their own within seconds")
        return 0
    print(f"lorarl stop: pid {record.pid} survived SIGKILL for 10 s", file=sys.stderr)
    return 1


def _exits(record: LauncherRecord, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while record.liveness() == "running":
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True
