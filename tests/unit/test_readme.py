"""README.md stays what issue "the first hour" asked of it: short, its links alive, its example the shipped file,
and every figure it quotes marked stale exactly when bench/RESULTS.md marks the run it comes from."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAX_LINES = 400


def test_the_readme_is_at_most_400_lines():
    assert README.count("\n") <= MAX_LINES, (f"README.md is {README.count(chr(10))} lines: move detail to a page "
                                             "under docs/ and link it")


def test_every_local_link_and_named_page_exists():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) + re.findall(r"`((?:docs|bench|examples)/[\w./-]+)`",
                                                                            README)
    missing = sorted({t for t in targets if not t.startswith("http") and not (ROOT / t).exists()})
    assert not missing, missing
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name}: dead link {link}"


def test_the_example_job_shown_is_the_shipped_one():
    blocks = re.findall(r"```(yaml|python)\n(.*?)```", README, flags=re.S)
    job = next(text for lang, text in blocks if lang == "yaml" and "job_id: own-job" in text)
    assert job == (ROOT / "examples" / "own-job" / "job.yaml").read_text()
    reward = next(text for lang, text in blocks if lang == "python" and "def score" in text)
    body = reward.split("\n", 1)[1]  # after the "# examples/own-job/myreward.py" line
    assert body.strip() in (ROOT / "examples" / "own-job" / "myreward.py").read_text()


def records_by_commit() -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for path in (ROOT / "bench" / "records").glob("*/*.json"):
        record = json.loads(path.read_text())
        commit = (record.get("provenance") or {}).get("commit", "")
        if commit:
            found.setdefault(commit[:7], []).append(record)
    return found


def test_each_figure_carries_the_staleness_mark_of_the_run_it_comes_from():
    """A README paragraph that cites a benchmark commit says "stale" when that run's record is marked stale, and
    does not when none is (the marks come from `python bench/results.py check --mark`)."""
    records = records_by_commit()
    cited = 0
    for paragraph in re.split(r"\n\s*\n", README):
        for commit in re.findall(r"commit ([0-9a-f]{7,40})\b", paragraph):
            runs = records.get(commit[:7])
            assert runs, f"README cites commit {commit}, which no bench/records run has"
            cited += 1
            stale = any(run.get("stale") for run in runs)
            marked = "stale" in paragraph.lower()
            assert marked == stale, (f"README's figure at commit {commit} must {'' if stale else 'not '}say 'stale' "
                                     f"(bench/RESULTS.md marks its run {'stale' if stale else 'fresh'}):\n{paragraph}")
    assert cited >= 1
