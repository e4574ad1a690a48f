"""bench/results.py keeps every benchmark's section and replaces only the run it rewrites."""

from pathlib import Path

from bench.results import write_results


def test_sections_are_kept_and_runs_replaced(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    write_results("## A", "### cpu", ["a1"], path)
    write_results("## B", "### cpu", ["b1"], path)
    write_results("## A", "### cuda", ["a2"], path)
    write_results("## A", "### cpu", ["a3"], path)
    text = path.read_text()
    assert "a1" not in text and "a3" in text and "a2" in text and "b1" in text
    assert text.index("## A") < text.index("a3") < text.index("a2") < text.index("## B") < text.index("b1")


def test_every_run_names_its_commit_date_machine_and_command(tmp_path: Path) -> None:
    import re

    from bench.results import provenance

    path = tmp_path / "RESULTS.md"
    write_results("## A", "### cpu", ["a1"], path)
    line = path.read_text().splitlines()[path.read_text().splitlines().index("### cpu") + 2]
    assert re.fullmatch(r"Measured at commit [0-9a-f]{7,40}( with uncommitted changes)?, \d{4}-\d{2}-\d{2}, "
                        r"on \S+, \d+ CPUs.*, by `python .+`\.", line), line
    assert provenance(["bench/x.py", "--quick"]).endswith("by `python bench/x.py --quick`.")


def test_every_section_of_the_results_names_its_commit() -> None:
    import re

    text = (Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md").read_text()
    runs = re.split(r"(?m)^(?=### )", text)[1:]
    assert runs
    missing = [run.splitlines()[0] for run in runs if not re.search(r"commit [0-9a-f]{7,40}\b", run)]
    assert missing == []
