"""bench/RESULTS.md: every benchmark writes its run under its own section, keeping the others."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_results(heading: str, title: str, body: list[str], path: Path = RESULTS) -> None:
    """Puts ``body`` under ``title`` (a ``###`` line) in the ``heading`` (``##``) section, replacing an
    older run with the same title; other sections and runs are kept."""
    lines = path.read_text().splitlines() if path.exists() else ["# Benchmark results"]
    block = [title, "", *body, ""]
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
