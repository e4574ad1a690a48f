"""bench/RESULTS.md is generated from machine-readable records (bench/records), each naming its commit, date,
machine and command; a run written by hand (no record) fails here, and the stale check finds runs whose code
changed after them."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench import results
from bench.results import all_runs, check, provenance, render, staleness, unmarked, write_results

ROOT = Path(__file__).resolve().parents[2]


def test_sections_are_kept_and_runs_replaced(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    write_results("## A", "### cpu", ["a1"], path)
    write_results("## B", "### cpu", ["b1"], path)
    write_results("## A", "### cuda", ["a2"], path)
    write_results("## A", "### cpu", ["a3"], path)
    text = path.read_text()
    lines = text.splitlines()  # whole lines: a provenance line's commit hash may hold "a2" (7da265e did)
    assert "a1" not in lines and "a3" in lines and "a2" in lines and "b1" in lines
    assert lines.index("## A") < lines.index("a3") < lines.index("a2") < lines.index("## B") < lines.index("b1")
    assert text == render(tmp_path / "records")


def test_every_run_is_a_record_with_its_commit_date_machine_versions_command_and_numbers(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    write_results("## A", "### cpu", ["| n | s |", "| ---: | ---: |", "| 1 | 2.5 |"], path)
    line = path.read_text().splitlines()[path.read_text().splitlines().index("### cpu") + 2]
    assert re.fullmatch(r"Measured at commit [0-9a-f]{7,40}( with uncommitted changes)?, \d{4}-\d{2}-\d{2}, "
                        r"on \S+, \d+ CPUs.*\(python 3[\d.]+, torch [^)]+\), by `python .+`\.", line), line
    assert provenance(["bench/x.py", "--quick"]).endswith("by `python bench/x.py --quick`.")
    [(_, _, record)] = all_runs(tmp_path / "records")
    assert record["provenance"]["versions"]["torch"] and record["provenance"]["command"].startswith("python ")
    assert record["tables"] == [{"columns": ["n", "s"], "rows": [["1", "2.5"]]}]


def test_results_md_is_what_its_records_render() -> None:
    """A run added to RESULTS.md by hand has no record: write runs with bench.results.write_results."""
    rendered = render(ROOT / "bench" / "records")
    on_disk = (ROOT / "bench" / "RESULTS.md").read_text()
    if rendered != on_disk:
        import difflib
        diff = "".join(list(difflib.unified_diff(rendered.splitlines(True), on_disk.splitlines(True),
                                                 "rendered from bench/records", "bench/RESULTS.md"))[:40])
        pytest.fail("bench/RESULTS.md differs from what its records render (a run without a record, or an edit "
                    f"by hand; write runs with bench.results.write_results):\n{diff}")


def test_every_record_names_a_commit_of_this_history_a_date_and_a_command() -> None:
    runs = all_runs(ROOT / "bench" / "records")
    assert len(runs) >= 20
    problems = []
    for _, name, run in runs:
        p = run["provenance"]
        known = subprocess.run(["git", "cat-file", "-t", p["commit"]], cwd=ROOT, capture_output=True, text=True)
        if known.stdout.strip() != "commit":
            problems.append(f"{name}: commit {p['commit']!r} is not in this repository's history")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", p["date"]) or p["command"] == "unknown" or p["machine"] == "unknown":
            problems.append(f"{name}: date {p['date']!r}, machine {p['machine']!r}, command {p['command']!r}")
    assert problems == []


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_stale_check_finds_runs_whose_measured_code_changed_and_marks_them(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    (repo / "lorarl" / "core").mkdir(parents=True)
    (repo / "lorarl" / "other").mkdir(parents=True)
    (repo / "lorarl" / "__init__.py").write_text("")
    (repo / "lorarl" / "core" / "__init__.py").write_text("")
    (repo / "lorarl" / "core" / "math.py").write_text("from lorarl.core import helper\n")
    (repo / "lorarl" / "core" / "helper.py").write_text("X = 1\n")
    (repo / "lorarl" / "other" / "__init__.py").write_text("")
    (repo / "lorarl" / "other" / "unrelated.py").write_text("Y = 1\n")
    (repo / "bench" / "fast.py").write_text("def main():\n    from lorarl.core.math import helper\n")
    (repo / "bench" / "whole.py").write_text('MEASURES = ("lorarl",)\n')
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "first")
    first = git(repo, "rev-parse", "--short", "HEAD")
    assert results.measured_paths("python bench/fast.py --quick", repo) == [
        "bench/fast.py", "lorarl/__init__.py", "lorarl/core/__init__.py", "lorarl/core/helper.py",
        "lorarl/core/math.py"]
    records = repo / "bench" / "records"
    for script in ("fast", "whole"):
        write_results("## S", f"### {script}", ["x"], repo / "bench" / "RESULTS.md",
                      source=f"Measured at commit {first}, 2026-12-04, on x86_64, 2 CPUs, by "
                             f"`python bench/{script}.py`.")
    fast, whole = (run for _, _, run in all_runs(records))
    assert staleness(fast, repo) is None and staleness(whole, repo) is None
    (repo / "lorarl" / "other" / "unrelated.py").write_text("Y = 2\n")
    git(repo, "commit", "-qam", "unrelated")
    assert staleness(fast, repo) is None and staleness(whole, repo)["changed"] == ["lorarl/other/unrelated.py"]
    (repo / "lorarl" / "core" / "helper.py").write_text("X = 2\n")  # imported through math.py
    git(repo, "commit", "-qam", "helper")
    found = staleness(fast, repo)
    assert found["changed"] == ["lorarl/core/helper.py"] and found["commits"] == 1 and found["since"] == first
    # CI's read-only check: both runs are stale and neither record says so yet
    assert len(unmarked(records, repo)) == 2 and "(checked at" in unmarked(records, repo)[0]
    lines = check(records, repo, mark=True, results=repo / "bench" / "RESULTS.md")
    assert unmarked(records, repo) == []  # marked: CI passes while they wait to be re-measured
    assert len(lines) == 2 and "fast" in lines[0] and "`lorarl/core/helper.py` changed in 1 commit(s)" in lines[0]
    text = (repo / "bench" / "RESULTS.md").read_text()
    assert text.count("> **Stale**") == 2 and text == render(records)
    # re-measured: the fresh run replaces the stale one and its mark
    write_results("## S", "### fast", ["y"], repo / "bench" / "RESULTS.md")
    assert (repo / "bench" / "RESULTS.md").read_text().count("> **Stale**") == 1
    assert json.loads((records / "index.json").read_text())["sections"][0]["runs"] == ["fast", "whole"]
