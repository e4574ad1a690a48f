"""How fast and how busy the machine is while the suite runs: the two readings the time budget's pace is made of.

*Speed*: `calibrate` times a fixed workload (pure Python and hashing, no lorarl code) in the CPU seconds of its
own thread, so it reads the CPU, not its share of it: beside 0 to 3 busy-looping processes on the 2-core
development machine its CPU seconds stayed 0.028-0.033 while its wall seconds went from 0.032 to 0.065. (Until
stop 54 it read wall seconds, which mostly measured the suite's own processes: 0.026 s idle, 0.074-0.090 s
during a quiet suite; and a busy loop beside the suite moved it only 1.15x while the suite ran 1.54x slower,
since a short sleeper gets the CPU back sooner than the suite's long-running processes do.)

*Load*: `MachineLoad` reads the CPU time the machine spent outside the suite's own process tree while the run
lasted (/proc/stat's busy ticks on the CPUs this process may use, less the ticks of the controlling process
and every descendant, reaped ones included through their parents' children-time). Other work beside the suite
leaves it ``cores - foreign`` CPUs, so it runs ``cores / (cores - foreign)`` slower: that is the load factor.
Linux only; elsewhere, and under a cgroup CPU quota (where the host's busy ticks are not this job's
neighbours), the load factor is 1 and the report says why. Hand-written: psutil would read the same files,
and it is not a dependency of the suite.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: Seconds between two samples of the calibration workload while the suite runs.
CALIBRATE_EVERY_S = 15.0
#: The load factor's bound: a neighbour using all but a quarter of a CPU does not lift the budget without end.
MAX_LOAD = 4.0
PROC = Path("/proc")


def calibrate() -> float:
    """CPU seconds of this thread for one fixed workload: an interpreter loop and SHA-256 over a buffer (~0.03 s on
    the 2-core development machine, busy or idle). It reads the machine, not the code under test: nothing in it
    changes when lorarl does."""
    import hashlib

    start = time.thread_time()
    total = 0
    for i in range(200_000):
        total += (i * i) % 7
    block = bytes(range(256)) * 4096  # 1 MiB
    digest = hashlib.sha256()
    for _ in range(24):
        digest.update(block)
    digest.hexdigest()
    return time.thread_time() - start


class PaceClock:
    """Samples `calibrate` on a background thread of the controlling process for as long as the run lasts."""

    def __init__(self, every_s: float = CALIBRATE_EVERY_S) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lorarl-pace-clock", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(calibrate())
            self._stop.wait(self.every_s)

    def median(self) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return ordered[len(ordered) // 2]


def cpu_quota() -> str | None:
    """The cgroup v2 CPU quota of this process ("max 100000" is none), or None where there is none to read."""
    try:
        line = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        return None
    return None if not line or line[0] == "max" else " ".join(line)


def busy_ticks(cpus: set[int]) -> int:
    """Ticks the given CPUs spent on anything but idling and waiting for I/O since boot (steal included: a
    hypervisor's other guests are neighbours too)."""
    total = 0
    for line in (PROC / "stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        total += user + nice + system + irq + softirq + steal
    return total


def tree_ticks(root: int) -> int:
    """CPU ticks of ``root`` and every live descendant, each with the ticks of the children it has reaped: the
    whole tree's CPU time since each began, ended processes included once their parent in the tree waited."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone while read
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the name may hold spaces
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
        ticks[pid] = utime + stime + cutime + cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


@dataclass(frozen=True)
class Reading:
    """The machine's CPU ticks and the tree's at one moment."""

    at: float
    busy: int
    tree: int


class MachineLoad:
    """Reads how much CPU work outside the process tree under ``root`` ran beside it between `start` and `stop`."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.why_not = self._why_not()
        self.first: Reading | None = None
        self.last: Reading | None = None

    def _why_not(self) -> str | None:
        if not (PROC / "stat").exists() or not self.cpus:
            return "no /proc/stat here"
        quota = cpu_quota()
        if quota:
            return f"a cgroup CPU quota ({quota}) makes the host's busy CPUs no measure of this job's neighbours"
        return None

    def read(self) -> Reading | None:
        if self.why_not:
            return None
        return Reading(time.monotonic(), busy_ticks(self.cpus), tree_ticks(self.root))

    def start(self) -> None:
        self.first = self.read()

    def stop(self) -> None:
        self.last = self.read()

    def foreign_cpus(self) -> float | None:
        """CPUs' worth of work outside the tree on average over the run (0.7: a neighbour took 0.7 of a CPU)."""
        if self.first is None or self.last is None or self.last.at <= self.first.at:
            return None
        foreign = (self.last.busy - self.first.busy) - (self.last.tree - self.first.tree)
        return max(0.0, foreign / self.hz / (self.last.at - self.first.at))

    def factor(self) -> float:
        """How much slower the suite ran for its neighbours: cores / (cores - foreign), between 1 and MAX_LOAD."""
        foreign = self.foreign_cpus()
        if foreign is None:
            return 1.0
        cores = len(self.cpus)
        return min(MAX_LOAD, max(1.0, cores / max(cores - foreign, cores / MAX_LOAD)))
