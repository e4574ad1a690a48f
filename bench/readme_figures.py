"""The learning figures README quotes, measured by one script: each example run as a user runs it, its held-out
greedy accuracy before and after, its steps, its loop time and the whole command's wall time.

    python bench/readme_figures.py                      # all (about 10 minutes on 2 CPU cores)
    python bench/readme_figures.py --only demo,sdk      # some of them
    python bench/readme_figures.py --no-write           # print, leave bench/RESULTS.md as it is

- demo: `lorarl run examples/demo.yaml` (`make demo`);
- sdk: `python examples/sdk/finetune.py` (the hand-written loop over the Python SDK, 30 steps);
- agent: `lorarl run examples/agent-tools.yaml` (the calculator agent through the OpenAI endpoint);
- multitenant: `lorarl run examples/multitenant/sort.yaml examples/multitenant/tools.yaml` (two jobs, one stack).
Each runs once, at the example's own seed, one after another on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as a user does.
MEASURES = ("lorarl", "examples")
HEADING = "## README figures: the examples' learning"
EXAMPLES = ("demo", "sdk", "agent", "multitenant")


@dataclass
class Figure:
    example: str
    command: str
    before: float
    after: float
    steps: int
    loop_s: float | None
    wall_s: float

    def row(self) -> str:
        loop = f"{self.loop_s:.1f}" if self.loop_s is not None else "-"
        return (f"| {self.example} | `{self.command}` | {self.before:.3f} | {self.after:.3f} | "
                f"{100 * (self.after - self.before):+.1f} | {self.steps} | {loop} | {self.wall_s:.0f} |")


def lorarl() -> list[str]:
    script = Path(sys.executable).parent / "lorarl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]


def from_run_dir(example: str, command: str, out: Path, wall_s: float) -> Figure:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    return Figure(example, command, evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"], len(steps),
                  evals[-1]["time_s"], wall_s)


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done, time.perf_counter() - started


def measure(example: str, tmp: Path) -> list[Figure]:
    quiet = ["output.tensorboard=false", "output.progress=false", "--fresh"]
    if example in ("demo", "agent"):
        job = {"demo": "examples/demo.yaml", "agent": "examples/agent-tools.yaml"}[example]
        _, wall = timed([*lorarl(), "run", job, f"output.dir={tmp / example}", *quiet])
        return [from_run_dir(example, f"lorarl run {job}", tmp / example, wall)]
    if example == "sdk":
        done, wall = timed([sys.executable, "examples/sdk/finetune.py"])
        before = float(re.search(r"accuracy before: ([\d.]+)", done.stdout).group(1))
        after = float(re.search(r"accuracy after:\s+([\d.]+)", done.stdout).group(1))
        steps = len(re.findall(r"^step \d+/", done.stdout, re.M))
        return [Figure(example, "python examples/sdk/finetune.py", before, after, steps, None, wall)]
    jobs = ["sort", "tools"]
    folder = ROOT / "examples" / "multitenant"
    files = []
    for name in jobs:  # the example's files with their output here (data by absolute path)
        cfg = yaml.safe_load((folder / f"{name}.yaml").read_text())
        cfg["output"]["dir"] = str(tmp / name)
        for key in ("train_path", "test_path"):
            if key in cfg["data"]:
                cfg["data"][key] = str((folder / cfg["data"][key]).resolve())
        files.append(tmp / f"{name}.yaml")
        files[-1].write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(folder)}  # the agent's workflow, beside the example's job files
    _, wall = timed([*lorarl(), "run", *map(str, files), *quiet], env)
    command = "lorarl run examples/multitenant/sort.yaml examples/multitenant/tools.yaml"
    return [from_run_dir(f"multitenant: {name}", command, tmp / name, wall) for name in jobs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(EXAMPLES))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    chosen = args.only.split(",")
    if unknown := sorted(set(chosen) - set(EXAMPLES)):
        parser.error(f"unknown example(s) {unknown}; from {list(EXAMPLES)}")
    figures = []
    with tempfile.TemporaryDirectory(prefix="lorarl-readme-") as name:
        for example in chosen:
            figures += measure(example, Path(name))
            print(figures[-1].row(), flush=True)
    body = ["| example | command | held-out before | after | points | steps | loop s | command s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |", *(f.row() for f in figures), "",
            "Held-out greedy accuracy (the SDK example: its own greedy evaluation on the shipped test split); "
            "'loop s' from the run's metrics (time of its last evaluation), 'command s' the whole command, "
            "service start-up and shutdown included."]
    print("\n".join(body))
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### {', '.join(chosen)}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
