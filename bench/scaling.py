"""The whole loop at real shapes and lengths: how step time and trainer memory grow with completions.

A random-init model with Qwen3-0.6B's layer shapes (2 layers, the full 151,936-token vocabulary;
lorarl.assets.models.build_random_model) runs the demo job through `lorarl run`'s own stack (three services
on loopback, vLLM on CPU, sync loop, rank-32 LoRA, one prompt a step) with completions of 256, 1024
and 4096 tokens and groups of 4 and 16. A random policy rarely samples EOS, so completions run to
max_tokens (the table prints the real token counts). Per setting: the last step's time (generation,
training, weight sync; one step by default: at these sizes start-up effects are small), rollout
tokens per second, and the trainer process's peak resident set; then two fitted exponents (least
squares on logs):

- step time against tokens per step (goal <= 1.1: no worse than linear in the work);
- trainer peak memory against completion length at a fixed micro-batch budget (goal ~0: longer
  completions split into more micro-batches, not bigger ones).

    .venv/bin/python bench/scaling.py                 # six settings, ~40 minutes on 2 cores
    .venv/bin/python bench/scaling.py --quick --no-write
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## lorarl at real shapes: scaling with completion length"
SHAPE, LAYERS = "qwen3-0.6b", 2
MICRO_BATCH_TOKENS = 4352  # one 4096-token completion and its prompt, or several shorter ones
FULL = [(c, g) for c in (256, 1024, 4096) for g in (4, 16)]
QUICK = [(32, 4), (64, 4)]


@dataclass(frozen=True)
class Point:
    completion: int
    group: int
    tokens: float  # completion tokens the step generated and trained on
    step_s: float
    generate_s: float
    train_s: float
    sync_s: float
    tokens_per_s: float
    trainer_peak_gib: float


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """Slope of log y against log x (least squares)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    var = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / var if var else float("nan")


def peak_rss_gib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def run_setting(model_dir: Path, out: Path, completion: int, group: int, steps: int) -> Point:
    from bench.lorarl_job import run_job
    from lorarl.client.job.config import load_job_config

    cfg = load_job_config(str(ROOT / "examples/demo.yaml"), [
        f"model.path={model_dir}", "loop.mode=sync", f"loop.steps={steps}", "loop.prompts_per_step=1",
        "loop.eval_every=0", "data.eval_size=1", f"rollout.group_size={group}", f"rollout.max_tokens={completion}",
        "rollout.eval_max_tokens=1", "rollout.kv_cache_gib=2", "trainer.lora.rank=32", "trainer.lora.alpha=64",
        "rollout.max_lora_rank=32",
        f"trainer.optimizer.micro_batch_tokens={MICRO_BATCH_TOKENS}", f"output.dir={out}", "output.tensorboard=false",
        "output.progress=false"])
    peak: list[float] = []
    timing = run_job(cfg, out, before_stop=lambda stack: peak.append(
        peak_rss_gib(stack.processes["trainer"].process.pid)))
    rows = timing.steps
    last = rows[-1]
    step_s = last["time_s"] - rows[-2]["time_s"] if len(rows) > 1 else last["time_s"]
    return Point(completion, group, last["rollout/tokens"], step_s, last["rollout/seconds"],
                 last.get("train/time_s", float("nan")), last.get("sync/seconds", 0.0),
                 last["rollout/tokens_per_s"], peak[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short settings (a smoke test)")
    parser.add_argument("--steps", type=int, default=1, help="steps per setting (the last one is reported)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    parser.add_argument("--settings", default="", help="only these, e.g. '4096x4,4096x16' (completion x group)")
    args = parser.parse_args()

    import torch

    from lorarl.assets.models import build_random_model

    settings = QUICK if args.quick else FULL
    if args.settings:
        settings = [tuple(int(v) for v in item.split("x")) for item in args.settings.split(",")]
    points = []
    lines = ["| completion | group | tokens/step | step s | generate s | train s | sync s | rollout tok/s | "
             "trainer peak GiB |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory(prefix="lorarl-scaling-") as tmp:
        model_dir = Path(tmp) / "model"
        build_random_model(SHAPE, model_dir, num_layers=LAYERS, dtype=torch.float32)
        for completion, group in settings:
            p = run_setting(model_dir, Path(tmp) / f"run-{completion}-{group}", completion, group, args.steps)
            points.append(p)
            line = (f"| {p.completion} | {p.group} | {p.tokens:.0f} | {p.step_s:.1f} | {p.generate_s:.1f} | "
                    f"{p.train_s:.1f} | {p.sync_s:.2f} | {p.tokens_per_s:.0f} | {p.trainer_peak_gib:.2f} |")
            print(line, flush=True)
            lines.append(line)
    if len(points) < 2:
        return 0
    time_exp = fit_exponent([p.tokens for p in points], [p.step_s for p in points])
    memory_exps = []
    for group in sorted({p.group for p in points}):
        mine = [p for p in points if p.group == group]
        memory_exps.append(fit_exponent([p.completion for p in mine], [p.trainer_peak_gib for p in mine]))
    # The largest group fills the micro-batch budget at every length: the fixed-budget case the goal is about
    # (smaller groups' short completions fit in less than one budget, so their first micro-batches are smaller).
    memory_exp = memory_exps[-1]
    groups = sorted({p.group for p in points})
    summary = [f"step time ~ (tokens per step)^{time_exp:.2f} (goal <= 1.1: {'PASS' if time_exp <= 1.1 else 'FAIL'})",
               f"trainer peak memory ~ (completion length)^{memory_exp:.2f} at group {groups[-1]}, "
               f"{MICRO_BATCH_TOKENS}-token micro-batches (goal ~0: {'PASS' if abs(memory_exp) <= 0.15 else 'FAIL'}; "
               "per group size " + ", ".join(f"{g}: {e:.2f}" for g, e in zip(groups, memory_exps, strict=True)) + ")"]
    for line in summary:
        print(line)
    if not args.no_write:
        from bench.results import write_results

        title = (f"### {time.strftime('%Y-%m-%d')}, {SHAPE} shape x {LAYERS} layers (random init, fp32), "
                 f"{platform.machine()} {os.cpu_count()} cores{' (quick)' if args.quick else ''}")
        write_results(HEADING, title, [*lines, "", *summary])
    return 0


if __name__ == "__main__":
    sys.exit(main())
