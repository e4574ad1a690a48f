"""Pinning a whole process to a set of CPUs.

On a machine with fewer cores than busy processes (the CPU demo: vLLM's engine core, the trainer and
the rollout frontend on two cores) the OS moves the busy processes from core to core, and each move
costs the mover its warm caches. Keeping the two heaviest on cores of their own made `lorarl run`'s
steps 6-7% shorter here (bench/RESULTS.md). Linux keeps affinity per thread and a new thread starts
with its creator's, so every thread already running is set, and later ones inherit it.

CPU sets are written as Linux cpulists, the form of ``taskset -c`` and /proc: ``"1"``, ``"0-3,8"``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; ValueError saying what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"a CPU list like '1' or '0-3,8', got {text!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"a CPU range runs low-high, got {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = None
    for cpu in [*ordered, None]:
        if start is not None and (cpu is None or cpu != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if cpu is not None and start is None:
            start = cpu
        prev = cpu
    return ",".join(parts)


def cpu_list(value: str | None) -> str | None:
    """Config check: empty/None (no pinning) or a valid CPU list."""
    if not value:
        return None
    try:
        parse_cpu_list(value)
    except ValueError as e:
        return str(e)
    return None


def check_cpu_setting(key: str, value: str) -> None:
    """Config validation of a CPU-list key (syntax is the field's check): ConfigError naming ``key``
    when the machine lacks one of its CPUs."""
    from lorarl.common.config import ConfigError

    try:
        check_cpus(parse_cpu_list(value))
    except ValueError as e:
        raise ConfigError(key, str(e)) from None


def available_cpus() -> list[int]:
    """The CPUs this process runs on now (what `lorarl run` divides; `taskset` narrows it)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def machine_cpus() -> list[int]:
    """The machine's online CPUs: a process may be pinned to any of them (a container's cpuset may
    refuse some; pin_process reports that)."""
    try:
        return parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text().strip())
    except (OSError, ValueError):
        return list(range(os.cpu_count() or 1))


def check_cpus(cpus: Iterable[int]) -> list[int]:
    """The CPUs, sorted, if this machine has all of them; else ValueError naming the ones it has."""
    wanted = sorted(set(cpus))
    if not wanted:
        raise ValueError("an empty CPU set")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("CPU pinning needs Linux (os.sched_setaffinity)")
    have = machine_cpus()
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise ValueError(f"CPUs {format_cpu_list(missing)} are not available here "
                         f"(this machine has CPUs {format_cpu_list(have)})")
    return wanted


def pin_process(cpus: Iterable[int]) -> list[int]:
    """Pins every thread of this process to ``cpus`` (ValueError when the machine or the OS refuses
    them); returns the union of the threads' CPU sets afterwards: ``cpus`` when every thread took it."""
    wanted = set(check_cpus(cpus))
    try:
        os.sched_setaffinity(0, wanted)  # this thread first: threads it starts from now on inherit it
    except OSError as e:
        raise ValueError(f"the OS refused CPUs {format_cpu_list(wanted)} for this process ({e.strerror}; "
                         "a container's cpuset may exclude them)") from None
    for tid in thread_ids():
        with contextlib.suppress(OSError):  # a thread that has just exited
            os.sched_setaffinity(tid, wanted)
    return thread_cpus()


def thread_cpus() -> list[int]:
    """Every CPU some thread of this process may run on (for checks and logs)."""
    seen: set[int] = set()
    for tid in thread_ids():
        with contextlib.suppress(OSError):
            seen.update(os.sched_getaffinity(tid))
    return sorted(seen) or available_cpus()


def thread_ids() -> list[int]:
    """This process's threads (Linux; none elsewhere). Per-thread settings (affinity, niceness) must be
    set on each; one may exit before it is reached."""
    tasks = Path("/proc/self/task")
    return [int(task.name) for task in tasks.iterdir() if task.name.isdigit()] if tasks.is_dir() else []
