"""Which process owns a run directory: ``RUN_DIR/services/launcher.json``, written by `lorarl run` while it runs.

`lorarl stop RUN_DIR` signals that process and `lorarl status RUN_DIR` says whether it is alive. A pid alone can
name another process by the time it is read (the launcher was SIGKILLed, the pid was reused), so the record
also holds the process's start time as the kernel counts it (``/proc/PID/stat``): a live pid whose start time
differs is someone else's. The file is removed when the launcher leaves the block; one that outlives its
process (SIGKILL, a power cut) is stale, and is said so rather than trusted.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lorarl.common.ready import read_ready_file, write_ready_file

RECORD = "launcher.json"

#: "running": the recorded process is alive and is the launcher; "gone": no process runs under its pid; "reused": a
#: process has its pid but started at another time (the launcher is gone).
Liveness = Literal["running", "gone", "reused"]


def record_path(services_dir: Path) -> Path:
    return services_dir / RECORD


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` from its third field (the state) on, or None where there is no /proc (not Linux) or no
    such process. The name field may hold spaces and parentheses: fields are counted from its closing one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split() if ")" in stat else []
    return fields if len(fields) > 19 else None


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of ``/proc/PID/stat``), None where unknown."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def pid_alive(pid: int) -> bool:
    """Whether a process runs under this pid: one of another user's counts (signalling it is refused, not absent);
    a zombie does not (it has exited, and only waits for its parent to read its status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(pid)
    return fields is None or fields[0] != "Z"


@dataclass(frozen=True)
class LauncherRecord:
    pid: int
    started_at: float  # wall clock, for people
    process_start: int | None  # kernel ticks since boot, for telling this process from a later one of its pid
    command: list[str]

    def liveness(self) -> Liveness:
        if not pid_alive(self.pid):
            return "gone"
        now = process_start(self.pid)
        if self.process_start is not None and now is not None and now != self.process_start:
            return "reused"
        return "running"

    def describe(self) -> str:
        """``pid 123, started 2024-05-01 12:00:00 (`lorarl run job.yaml`)``."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return f"pid {self.pid}, started {when} (`{' '.join(['lorarl', *self.command])}`)"


def read_record(services_dir: Path) -> LauncherRecord | None:
    """The record in ``services_dir``, None when there is none; ValueError when the file is no record."""
    path = record_path(services_dir)
    if not path.is_file():
        return None
    try:
        raw = read_ready_file(path)
        return LauncherRecord(int(raw["pid"]), float(raw["started_at"]),
                              None if raw.get("process_start") is None else int(raw["process_start"]),
                              [str(part) for part in raw.get("command", [])])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a launcher record ({type(e).__name__}: {e})") from None


def this_process() -> LauncherRecord:
    return LauncherRecord(os.getpid(), time.time(), process_start(os.getpid()), sys.argv[1:])


@contextlib.contextmanager
def launcher_recorded(*services_dirs: Path) -> Iterator[LauncherRecord]:
    """This process recorded as the launcher of each run directory's services (one stack serves several jobs'
    directories in `lorarl run A B`) while the block runs; each file removed after it, if it still names this
    process."""
    record = this_process()
    written = []
    for folder in services_dirs:
        write_ready_file(record_path(folder), {"pid": record.pid, "started_at": record.started_at,
                                               "process_start": record.process_start, "command": record.command})
        written.append(folder)
    try:
        yield record
    finally:
        for folder in written:
            with contextlib.suppress(ValueError, OSError):
                found = read_record(folder)
                if found is not None and found.pid == record.pid:
                    record_path(folder).unlink(missing_ok=True)
