"""What makes a folder a run directory (a job's output.dir), for the commands that take one (`lorarl status`,
`lorarl stop`): a wrong folder is told apart from a run that is not running, with what to give instead."""

from __future__ import annotations

from pathlib import Path

#: What `lorarl run` writes in a job's output.dir: any one of them makes the folder a run directory.
RUN_DIR_MARKS = ("config.json", "state.json", "metrics.jsonl", "services")


def run_dir_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a run directory, in words a person can act on; None when it is one."""
    folder = Path(path)
    if folder.is_file():
        if folder.suffix in (".yaml", ".yml"):
            return (f"{folder} is a job file; give its run directory, the folder its output.dir names"
                    f"{_output_dir_hint(folder)}")
        return f"{folder} is a file; give a job's run directory (its output.dir, e.g. runs/demo)"
    if not folder.is_dir():
        return f"{folder} does not exist; give a job's run directory (its output.dir, e.g. runs/demo)"
    if not any((folder / mark).exists() for mark in RUN_DIR_MARKS):
        return (f"{folder} is not a run directory: it holds none of what `lorarl run` writes there "
                f"({', '.join(RUN_DIR_MARKS)}); give a job's output.dir, e.g. runs/demo")
    return None


def _output_dir_hint(job_file: Path) -> str:
    """`` (runs/x)``: the job file's output.dir as it writes it, where it can be read."""
    import yaml

    try:
        raw = yaml.safe_load(job_file.read_text())
        written = raw.get("output", {}).get("dir") if isinstance(raw, dict) else None
    except (OSError, yaml.YAMLError, AttributeError):
        return ""
    return f" ({written})" if isinstance(written, str) and written else ""
