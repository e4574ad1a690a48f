"""Every command README.md and docs/*.md show is run here, from the repository root, so the pages cannot drift
from the code (issue "the first hour").

Shown means: a line of a ```bash block, or an inline code span that starts with a program (`lorarl`, `python`,
`make`, `docker`, ...) and names something (a path, a job file or a KEY=VALUE), as opposed to prose that names a
subcommand. How each runs:

- `lorarl run` / `lorarl train` with job files: as written plus `--dry-run` (every key, every data row, the plan;
  the e2e tests run the jobs themselves), and the same from another folder with the job files' absolute paths;
- `lorarl slurm`: run as written from a scratch folder (it writes the script, submits nothing);
- `lorarl --version` and `--help`: run;
- any other `lorarl` command (it needs running services or a run directory): parsed by the real command line,
  which refuses an unknown subcommand, flag or argument, with its job file loaded where it names one;
- `python SCRIPT` / `python -m MODULE`: its `--help`, in this process, unless a test named in RUN_BY_TEST runs it;
- `make TARGET`: the target exists in the Makefile;
- the programs in NOT_RUN (docker, kubectl, sbatch, ...) cannot run here: each with its reason, and the list is
  kept in sync with the pages (a program no page uses any more must leave it).

Placeholders in command synopses (JOB.yaml, RUN_DIR, H:P ...) stand for the values in PLACEHOLDERS.
"""

from __future__ import annotations

import contextlib
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorarl.client import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Programs shown in the pages that cannot run in the suite, and why.
NOT_RUN = {
    "docker": "builds images and runs containers: CI has no Docker daemon (deploy/ files are checked by "
              "tests/unit/deploy/)",
    "kubectl": "needs a Kubernetes cluster (the manifests are checked by tests/unit/deploy/)",
    "sbatch": "needs a Slurm cluster (`lorarl slurm` writing the script runs here)",
    "torchrun": "starts trainer ranks across nodes and devices",
    "pip": "installs from the network; CI's install is `make setup`",
    "venv": "creates a virtualenv; `make setup` does",
    "export": "sets the shell's environment; the commands after it are checked",
    "umask": "writes a token file; tests/e2e/test_readme_recipe.py runs that block as written",
    "source": "activates a virtualenv",
}
#: Commands a named test runs in full: the test must name the script or read the page.
RUN_BY_TEST = {
    "examples/tinker/rl_loop.py": "tests/e2e/test_tinker_rl_loop.py",
    "examples/tinker/cookbook_rl.py": "tests/e2e/test_tinker_rl_loop.py",
    "examples/tinker/cookbook_distill.py": "tests/e2e/test_tinker_rl_loop.py",
}
#: What synopsis placeholders stand for when a command is parsed.
PLACEHOLDERS = {
    "JOB.yaml": "examples/demo.yaml", "A.yaml": "examples/multitenant/sort.yaml",
    "B.yaml": "examples/multitenant/tools.yaml", "/abs/path/to/examples/demo.yaml": "examples/demo.yaml",
    "C.yaml": "examples/demo.yaml", "job.yaml": "examples/demo.yaml", "RUN_DIR": "runs/demo", "runs/A": "runs/demo",
    "DIR": "runs/demo/exports/demo/final-adapter", "OUT": "data/out", "H:P": "127.0.0.1:50051",
    "HOST:PORT": "127.0.0.1:50051", "T:50051": "127.0.0.1:50051", "R:50052": "127.0.0.1:50052",
    "W:50053": "127.0.0.1:50053", "HEAD:6379": "127.0.0.1:6379", "SERVICE": "trainer", "tinker.yaml": "tinker.yaml",
}
#: A subcommand that needs running services or a run directory is parsed, not run (with its job file loaded
#: where it takes one).
PARSED_ONLY = {"status", "stop", "eval", "export", "serve", "train", "tinker", "jobs", "data", "demo"}
TAKES_JOB_FILES = {"run", "train", "eval", "tinker", "slurm"}
FENCE = re.compile(r"^```(\w*)\s*$")
PROGRAM_SPAN = re.compile(r"(\.venv/bin/)?(lorarl|python3?|make|docker|kubectl|pip|sbatch|torchrun)\s")
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Shown:
    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def shown_commands() -> list[Shown]:
    """Every command line of every page, continuation lines joined, comments and `&&` chains split."""
    out: list[Shown] = []
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        lang: str | None = None
        pending = ""
        for number, line in enumerate(page.read_text().split("\n"), 1):
            fence = FENCE.match(line.strip())
            if fence:
                lang = None if lang is not None else (fence.group(1) or "text")
                continue
            if lang in SHELL:
                text = (pending + " " + line.strip()) if pending else line.strip()
                pending = ""
                if text.endswith("\\"):
                    pending = text[:-1].rstrip()
                    continue
                texts = [text]
            elif lang is None:
                texts = [span for span in re.findall(r"`([^`]+)`", line)
                         if re.match(PROGRAM_SPAN, span)
                         and re.search(r"[/=]|\.ya?ml\b|\.py\b|--version|--help", span)]
            else:
                continue
            for text in texts:
                text = re.split(r"\s#\s|\s{2,}#", text)[0].strip()
                for part in re.split(r"\s*&&\s*", text):
                    if part and not part.startswith("#"):
                        out.append(Shown(name, number, part))
    return out


def program(command: str) -> str:
    words = command.replace("(", " ").replace(";", " ").split()
    first = words[0].removeprefix(".venv/bin/")
    if first in ("python", "python3") and words[1:3] == ["-m", "venv"]:
        return "venv"
    return {".": "source"}.get(first, first)


def argv_of(command: str) -> list[str]:
    """The command's arguments after the program, placeholders replaced, optional [parts] and '...' dropped."""
    command = re.sub(r"\[[^\]]*\]", "", command)
    words = [w for w in shlex.split(command)[1:] if w != "..." and not w.endswith("...")]
    return [PLACEHOLDERS.get(w, w) for w in words]


COMMANDS = shown_commands()


def by_program(*names: str) -> list[Shown]:
    return [c for c in COMMANDS if program(c.text) in names]


def test_the_pages_show_commands_and_each_program_is_one_the_suite_knows():
    assert len(by_program("lorarl")) >= 20, "the extractor found too few commands: is its page format changed?"
    unknown = sorted({f"{program(c.text)} ({c})" for c in COMMANDS
                      if program(c.text) not in {"lorarl", "python", "python3", "make", *NOT_RUN}})
    assert not unknown, f"commands no rule of this test covers: say how to run them, or why not (NOT_RUN): {unknown}"


def test_every_program_that_cannot_run_here_is_still_shown_somewhere():
    used = {program(c.text) for c in COMMANDS}
    assert not set(NOT_RUN) - used, f"NOT_RUN names programs no page shows any more: {set(NOT_RUN) - used}"


def test_every_make_target_shown_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    missing = [str(c) for c in by_program("make") if argv_of(c.text)[0] not in targets]
    assert not missing


def run_cli(argv: list[str], cwd: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with contextlib.chdir(cwd):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse: --help, --version, a refused argument
            code = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def job_files(argv: list[str]) -> list[str]:
    return [a for a in argv[1:] if a.endswith((".yaml", ".yml")) and not a.startswith("-") and "=" not in a]


def lorarl_commands() -> list[Shown]:
    return by_program("lorarl")


def dry_run_key(argv: list[str]) -> tuple[str, ...]:
    """What a dry run depends on: the job files and overrides (not --fresh, not the order of flags)."""
    return tuple(sorted(a for a in argv if a not in ("--fresh", "--dry-run")))


#: Dry runs already checked in this process: several pages show the same job with other flags.
CHECKED: dict[tuple[str, ...], str] = {}
#: Job files already dry-run from another folder.
CHECKED_ELSEWHERE: set[str] = set()


def lorarl_cases() -> list[Shown]:
    return sorted({c.text: c for c in lorarl_commands()}.values(), key=str)


@pytest.mark.parametrize("shown", lorarl_cases(), ids=str)
def test_a_lorarl_command_shown_runs(shown: Shown, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = argv_of(shown.text)
    if argv[:1] in (["--version"], ["--help"]):
        code, out = run_cli(argv, ROOT, capsys)
        assert code == 0 and out.strip(), out
        return
    sub = argv[0]
    args = cli.parse(argv)  # the real command line: an unknown subcommand, flag or argument exits 2 here
    jobs = job_files(argv) if sub in TAKES_JOB_FILES else []
    if jobs and (sub == "train" or (sub == "run" and not args.attach)):
        dry = [*argv, "--dry-run"] if "--dry-run" not in argv else argv
        if dry_run_key(dry) not in CHECKED:
            code, out = run_cli(dry, ROOT, capsys)
            assert code == 0 and "config OK" in out, f"{shown}\n{out[-3000:]}"
            CHECKED[dry_run_key(dry)] = str(shown)
        if not set(jobs) <= CHECKED_ELSEWHERE:
            elsewhere = [str(ROOT / a) if a in jobs else a for a in dry]
            code, out = run_cli(elsewhere, tmp_path, capsys)
            assert code == 0 and "config OK" in out, f"{shown} (from another folder)\n{out[-3000:]}"
            CHECKED_ELSEWHERE.update(jobs)
    elif sub == "slurm":  # the script and its service configs go to a scratch output dir
        elsewhere = [str(ROOT / a) if a in jobs else a for a in argv] + [f"output.dir={tmp_path}"]
        code, out = run_cli(elsewhere, tmp_path, capsys)
        assert code == 0 and (tmp_path / "lorarl.sbatch").is_file(), f"{shown}\n{out[-3000:]}"
    else:
        assert sub in PARSED_ONLY | {"run"}, f"{shown}: say how this subcommand runs in this test"
        from lorarl.client.job.config import load_job_config

        for job in jobs:
            load_job_config(str(ROOT / job), list(getattr(args, "overrides", None) or []))


def python_commands() -> list[Shown]:
    return sorted({c.text: c for c in by_program("python", "python3") if program(c.text) != "venv"}.values(),
                  key=str)


@pytest.mark.parametrize("shown", python_commands(), ids=str)
def test_a_python_command_shown_runs(shown: Shown, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    argv = argv_of(shown.text)
    target = argv[1] if argv[0] == "-m" else argv[0]
    if target in RUN_BY_TEST:
        test = ROOT / RUN_BY_TEST[target]
        assert target in test.read_text(), f"{test} no longer runs {target}"
        return
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [target, "--help"])
    with pytest.raises(SystemExit) as done:
        if argv[0] == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            assert (ROOT / target).is_file(), f"{shown}: no such script"
            runpy.run_path(str(ROOT / target), run_name="__main__")
    assert done.value.code in (0, None), f"{shown}: --help exited {done.value.code}"
    assert "usage" in capsys.readouterr().out.lower()
