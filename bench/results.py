"""bench/RESULTS.md: every benchmark writes its run under its own section, keeping the others, and each
run names where its figures come from: the commit (and whether the tree had uncommitted changes), the
date, the machine and the command."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ROOT = RESULTS.parent.parent


def provenance(argv: list[str] | None = None) -> str:
    """One line: commit, date, machine and command of the run writing its results now."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        machine += f", {sys.modules['torch'].cuda.get_device_name(0)}"
    command = " ".join(["python", *(argv if argv is not None else [os.path.relpath(sys.argv[0], ROOT),
                                                                    *sys.argv[1:]])])
    return (f"Measured at commit {commit}{dirty}, {datetime.date.today().isoformat()}, on {machine}, by "
            f"`{command}`.")


def write_results(heading: str, title: str, body: list[str], path: Path = RESULTS, source: str | None = None) -> None:
    """Puts ``body`` under ``title`` (a ``###`` line) in the ``heading`` (``##``) section, after the run's
    provenance line (``source``, default `provenance()`), replacing an older run with the same title;
    other sections and runs are kept."""
    lines = path.read_text().splitlines() if path.exists() else ["# Benchmark results"]
    block = [title, "", source if source is not None else provenance(), "", *body, ""]
    if heading not in lines:
        lines = [*lines, "", heading, "", *block]
    else:
        start = lines.index(heading)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(("# ", "## "))), len(lines))
        if title in lines[start:end]:
            first = lines.index(title, start)
            last = next((i for i in range(first + 1, end) if lines[i].startswith(("# ", "## ", "### "))), end)
            lines = [*lines[:first], *block, *lines[last:]]
        else:
            lines = [*lines[:end], *([""] if lines[end - 1].strip() else []), *block, *lines[end:]]
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
