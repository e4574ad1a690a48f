"""Service logs with a size cap: what `lorarl run` keeps of each service's output over days.

A service's stdout and stderr go straight to its log file (``NAME.log``, opened for append), so everything
reaches it: Python logging, prints, a native library's warnings, the engine core's and the trainer ranks'
output (they inherit the descriptors), and a crash's last words. Rotation is done from outside, as
logrotate's ``copytruncate`` does it: when the file passes ``max_bytes`` its content is copied to ``NAME.log.1``
(older copies shift to ``.2`` ... ``.backups``; the oldest is dropped) and the file is truncated to zero;
every writer appends (O_APPEND), so its next line lands at the new start. Nothing in the service changes and no
pipe sits between a process and its log (a pipe's reader dying would take the output, or the writer, with it).
The price: a line written between the last copy and the truncate is lost; the copy is repeated until the size
stops moving, which leaves that window at one system call.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
#: How often sizes are looked at: a log passes its cap by at most what its service writes in this time.
CHECK_INTERVAL_S = 2.0


@dataclass(frozen=True)
class LogRetention:
    """How much of each service log is kept: the live file up to ``max_bytes`` (0: no cap) and ``backups``
    rotated copies of that size (0: the old content is dropped at each rotation)."""

    max_bytes: int = 64 * MIB
    backups: int = 2

    @classmethod
    def from_mib(cls, max_mib: float, backups: int) -> LogRetention:
        return cls(int(max_mib * MIB), backups)

    @property
    def bounded(self) -> bool:
        return self.max_bytes > 0


def backup_path(log: Path, index: int) -> Path:
    return log.with_name(f"{log.name}.{index}")


def rotate(log: Path, backups: int) -> None:
    """Copies ``log`` to ``log.1`` (shifting the older copies up, dropping the last) and truncates it."""
    if backups > 0:
        backup_path(log, backups).unlink(missing_ok=True)
        for index in range(backups - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(backup_path(log, index), backup_path(log, index + 1))
        with log.open("rb") as src, backup_path(log, 1).open("wb") as dst:
            while True:  # until the size stops moving: what a writer adds meanwhile is copied too
                shutil.copyfileobj(src, dst, 1 * MIB)
                if src.tell() >= os.fstat(src.fileno()).st_size:
                    break
    os.truncate(log, 0)


def rotate_if_full(log: Path, retention: LogRetention) -> bool:
    """Rotates ``log`` when it has reached the cap; whether it did."""
    if not retention.bounded:
        return False
    try:
        if log.stat().st_size < retention.max_bytes:
            return False
    except FileNotFoundError:
        return False
    rotate(log, retention.backups)
    return True


def read_since(log: Path, generation: int, offset: int, current: int, backups: int,
               limit: int) -> tuple[bytes, int, int]:
    """Up to ``limit`` bytes of ``log`` from where a reader stands, across rotations, and where it stands next.

    A reader stands at (``generation``, ``offset``): the log's rotation count when it began that file, and how far
    into it it read. ``current`` is the count now: a reader ``k`` rotations behind finds its file in ``log.k``,
    reads that to its end and goes on with the next generation from its start. A reader more than ``backups``
    behind lost what was dropped and goes on with the oldest copy kept (the Ray launcher streams each node's log
    to the host this way: the stream misses nothing a copy still holds)."""
    if current - generation > backups:
        generation, offset = current - backups, 0
    behind = current - generation
    path = backup_path(log, behind) if behind else log
    try:
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read(limit)
    except FileNotFoundError:
        chunk = b""
    if behind and len(chunk) < limit:  # that copy is read to its end: on to the next one
        return chunk, generation + 1, 0
    return chunk, generation, offset + len(chunk)


class LogRotator:
    """A daemon thread that keeps every log ``logs()`` names under ``retention`` until stopped."""

    def __init__(self, logs: Callable[[], Iterable[Path]], retention: LogRetention,
                 interval_s: float = CHECK_INTERVAL_S) -> None:
        self.logs, self.retention, self.interval_s = logs, retention, interval_s
        self.rotations = 0
        #: Rotations per log so far, counted after each truncate (read_since's ``current``).
        self.generations: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.retention.bounded and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lorarl-log-rotator", daemon=True)
            self._thread.start()

    def check(self) -> None:
        for log in list(self.logs()):
            try:
                if rotate_if_full(log, self.retention):
                    self.rotations += 1
                    self.generations[log] = self.generations.get(log, 0) + 1
            except OSError:  # a log being removed, a full disk: the next check tries again
                continue

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._thread = None


def main(argv: list[str] | None = None) -> int:
    """``python -m lorarl.client.launch.log_files FOLDER --max-bytes N --backups K``: keeps every ``*.log`` in
    FOLDER under that retention until SIGTERM (a Slurm job's batch script runs it beside its services)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--max-bytes", type=int, required=True)
    parser.add_argument("--backups", type=int, default=2)
    parser.add_argument("--interval-s", type=float, default=CHECK_INTERVAL_S)
    args = parser.parse_args(argv)
    if args.max_bytes < 0 or args.backups < 0 or args.interval_s <= 0:
        parser.error("--max-bytes and --backups must be >= 0, --interval-s > 0")
    rotator = LogRotator(lambda: sorted(args.folder.glob("*.log")), LogRetention(args.max_bytes, args.backups),
                         args.interval_s)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    while not stopped.wait(args.interval_s):
        rotator.check()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
