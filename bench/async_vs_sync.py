"""lorarl's asynchronous loop vs its synchronous loop at equal steps, side by side in one run.

The same job (examples/demo.yaml by default: 40 steps, 16 prompts x 8 samples) runs with
``loop.mode=sync`` and ``loop.mode=async``, each on a fresh local stack started as `lorarl run` starts
it, in the order sync, async, async, sync, ... (``--repeats`` pairs, so drift in the machine's load
hits both modes alike). Loop time is the steps alone: the loop's held-out evaluations (only before
and after: ``loop.eval_every=0``) are taken out. Speedup = sync / async of the fastest run of each
mode (on a shared machine the fastest run is the least disturbed); the mean is shown too.
Target: async >= 1.3x faster at equal final held-out accuracy, "equal" meaning the async mean within
``--tolerance`` (default 5 points, about 1.4 standard errors of the difference of two accuracies on
the 300 held-out problems) below the sync mean or above it.

    .venv/bin/python bench/async_vs_sync.py            # 2 x (sync + async), 40 steps each
    .venv/bin/python bench/async_vs_sync.py --quick    # smoke test: 3 steps, one pair, nothing written
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## lorarl: async vs sync loop"
SPEEDUP_TARGET = 1.3
TOLERANCE = 0.05
PROFILE_KEYS = (("rollout/seconds", "generate (rollout Generate RPC)"), ("train/time_s", "train step (trainer)"),
                ("sync/seconds", "publish -> active on the rollout"))


@dataclass
class ModeRun:
    """One run of one mode."""

    mode: str
    startup_s: float
    loop_s: float  # steps only: the loop's evaluations taken out
    final_accuracy: float
    base_accuracy: float
    profile: dict[str, float]  # mean seconds per step of each PROFILE_KEYS entry
    max_lag: int


def run_order(repeats: int) -> list[str]:
    """sync, async, async, sync, sync, async, ...: each mode equally often first."""
    order: list[str] = []
    for i in range(repeats):
        order += ["sync", "async"] if i % 2 == 0 else ["async", "sync"]
    return order


def summarize(runs: list[ModeRun], tolerance: float = TOLERANCE, target: float = SPEEDUP_TARGET) -> dict:
    """Speedups (best and mean) and the verdict."""
    by_mode = {m: [r for r in runs if r.mode == m] for m in ("sync", "async")}
    best = {m: min(r.loop_s for r in rs) for m, rs in by_mode.items()}
    mean = {m: statistics.fmean(r.loop_s for r in rs) for m, rs in by_mode.items()}
    accuracy = {m: statistics.fmean(r.final_accuracy for r in rs) for m, rs in by_mode.items()}
    speedup = best["sync"] / best["async"]
    equal = accuracy["async"] >= accuracy["sync"] - tolerance
    return {"best": best, "mean": mean, "accuracy": accuracy, "speedup": speedup,
            "mean_speedup": mean["sync"] / mean["async"], "equal": equal,
            "pass": speedup >= target and equal}


def table(runs: list[ModeRun], steps: int, tolerance: float = TOLERANCE) -> list[str]:
    s = summarize(runs, tolerance)
    ok = {True: "PASS", False: "FAIL"}
    acc_delta = 100 * (s["accuracy"]["async"] - s["accuracy"]["sync"])
    lines = [
        "| metric | sync | async | sync / async | target | result |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        f"| loop time, {steps} steps (fastest run) | {s['best']['sync']:.1f} s | {s['best']['async']:.1f} s | "
        f"{s['speedup']:.2f}x | >= {SPEEDUP_TARGET}x | {ok[s['speedup'] >= SPEEDUP_TARGET]} |",
        f"| loop time (mean of runs) | {s['mean']['sync']:.1f} s | {s['mean']['async']:.1f} s | "
        f"{s['mean_speedup']:.2f}x | | |",
        f"| final held-out accuracy (mean of runs) | {s['accuracy']['sync']:.3f} | {s['accuracy']['async']:.3f} | "
        f"{acc_delta:+.1f} points | async >= sync - {100 * tolerance:.0f} points | {ok[s['equal']]} |",
        f"| overall | | | | async >= {SPEEDUP_TARGET}x at equal accuracy | {ok[s['pass']]} |",
        "",
        "| run | mode | start-up | loop time | s/step | generate s/step | train s/step | publish s/step | "
        "max version lag | held-out accuracy |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for i, r in enumerate(runs, 1):
        p = [r.profile.get(k, 0.0) for k, _ in PROFILE_KEYS]
        lines.append(f"| {i} | {r.mode} | {r.startup_s:.1f} s | {r.loop_s:.1f} s | {r.loop_s / steps:.2f} | "
                     f"{p[0]:.2f} | {p[1]:.2f} | {p[2]:.2f} | {r.max_lag} | "
                     f"{r.base_accuracy:.3f} -> {r.final_accuracy:.3f} |")
    return lines


def run_mode(config: str, overrides: list[str], mode: str, out: Path) -> ModeRun:
    from bench.lorarl_job import run_job
    from lorarl.client.job.config import load_job_config

    cfg = load_job_config(config, [*overrides, f"loop.mode={mode}", f"output.dir={out}"])
    timing = run_job(cfg, out)
    profile = {key: statistics.fmean(row.get(key, 0.0) for row in timing.steps) for key, _ in PROFILE_KEYS}
    return ModeRun(mode, timing.startup_s, timing.train_s, timing.final_accuracy, timing.accuracy_at_step[0],
                   profile, int(max(row.get("policy/version_lag", 0) for row in timing.steps)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/demo.yaml")
    parser.add_argument("--steps", type=int, default=None, help="default: the config's loop.steps (40)")
    parser.add_argument("--prompts-per-step", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2, help="(sync, async) pairs, alternating which goes first")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="accuracy tolerance (fraction)")
    parser.add_argument("--out", default="runs/bench-async-vs-sync")
    parser.add_argument("--quick", action="store_true", help="3 steps, one pair; nothing written to RESULTS.md")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = args.steps or 3, 1
    overrides = ["output.tensorboard=false", "loop.eval_every=0", "job_id=bench-async-vs-sync"]
    for key, value in (("loop.steps", args.steps), ("loop.prompts_per_step", args.prompts_per_step)):
        if value is not None:
            overrides.append(f"{key}={value}")
    from lorarl.client.job.config import load_job_config

    cfg = load_job_config(str(ROOT / args.config), overrides)
    load_start = os.getloadavg()[0]
    runs = []
    for i, mode in enumerate(run_order(args.repeats), 1):
        print(f"run {i}: {mode} ...", flush=True)
        started = time.perf_counter()
        runs.append(run_mode(str(ROOT / args.config), overrides, mode, ROOT / args.out / f"{i}-{mode}"))
        r = runs[-1]
        print(f"run {i}: {mode}: loop {r.loop_s:.1f} s, held-out {r.final_accuracy:.3f} "
              f"({time.perf_counter() - started:.0f} s in all)", flush=True)
    import torch
    import vllm

    setup = (f"{platform.machine()}, {os.cpu_count()} CPUs, shared (load average {load_start:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end); torch {torch.__version__}, vllm {vllm.__version__}. Job: "
             f"{args.config} with loop.eval_every=0 ({cfg.loop.steps} steps, {cfg.loop.prompts_per_step} prompts x "
             f"{cfg.rollout.group_size} samples, {cfg.rollout.max_tokens} new tokens, async max_staleness "
             f"{cfg.loop.max_staleness}); each run starts its own three service processes (one OpenMP thread each) "
             f"as `lorarl run` does. Loop time = the steps (generate, train, publish), the held-out evaluations "
             f"before and after taken out; per-step columns are means of the loop's own timings (in async mode "
             f"generation overlaps the other two).")
    body = [setup, "", *table(runs, cfg.loop.steps, args.tolerance), "",
            f"Command: `.venv/bin/python bench/async_vs_sync.py{' --quick' if args.quick else ''}`"]
    print("\n".join(body))
    if not (args.quick or args.no_write):
        from bench.results import write_results

        write_results(HEADING, f"### cpu, {cfg.loop.steps} steps, {cfg.loop.prompts_per_step} x "
                               f"{cfg.rollout.group_size}, {args.repeats} pair(s)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
