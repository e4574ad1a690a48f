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
