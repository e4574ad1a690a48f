"""lorarl vs TRL's GRPOTrainer (PEFT LoRA, HF generate, CPU) on the same job, side by side in one run.

Both train the shipped tiny dense Qwen3 (lorarl/assets/models/qwen3-tiny, its byte-level tokenizer and ChatML
template) on the shipped tasks with the `exact` reward, with the job's group size, prompts per step,
learning rate, LoRA rank/alpha/targets, completion length, temperature, step count and GRPO loss
(examples/demo.yaml by default), on the same prompts in the same order:

1. lorarl: the three services start on loopback as `lorarl run` starts them (start-up timed apart),
   the job runs through the same RLLoop, and the trainer exports the adapter every K steps;
2. TRL: bench/trl_grpo.py in its own process with torch on all the cores (lorarl's services are
   down by then), saving the PEFT adapter every K steps;
3. one rollout service scores the base model and every saved adapter of both with the same greedy
   held-out evaluation (lorarl's eval path), so the curves are comparable.

Steps 1 and 2 run ``--rounds`` times, alternating (lorarl, TRL, lorarl, TRL, ...), so a drift of the
shared machine's speed hits both sides alike; each side's run with the shortest training time is
compared (TRL's over its thread counts too) and every run's times are listed under the table.

Time to target = training seconds (saves and evaluations excluded) at the first saved step whose
held-out accuracy reaches base + ``--target-gain``; targets: lorarl <= 0.5x TRL's time, and final
accuracy at least TRL's minus ``--tolerance``. Needs `make bench-setup` (trl).

    .venv/bin/python bench/trl_vs_lorarl.py            # the demo job: 40 steps, 16 prompts x 8
    .venv/bin/python bench/trl_vs_lorarl.py --quick    # smoke test: 4 steps, nothing written to RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## lorarl vs TRL GRPOTrainer"
TIME_TARGET = 0.5
TOLERANCE = 0.05
TARGET_GAIN = 0.30


@dataclass
class Curve:
    """One trainer's held-out accuracy against training seconds, at the saved steps."""

    name: str
    points: list[tuple[int, float, float]]  # (step, training seconds at its end, held-out accuracy)
    startup_s: float
    total_s: float

    @property
    def final_accuracy(self) -> float:
        return self.points[-1][2]

    @property
    def train_s(self) -> float:
        return self.points[-1][1]

    @property
    def steps(self) -> int:
        return self.points[-1][0]


def time_to_target(curve: Curve, target: float) -> tuple[int, float] | None:
    """(step, training seconds) at the first saved step with accuracy >= target; None if never."""
    return next(((step, seconds) for step, seconds, acc in curve.points if acc >= target - 1e-9), None)


def verdict(ours: Curve, peer: Curve, target: float, tolerance: float = TOLERANCE,
            time_target: float = TIME_TARGET) -> dict[str, Any]:
    """Time ratio to target and the two PASS/FAIL calls. When only the peer misses the target, its
    whole training time bounds its time to target from below, so the ratio is an upper bound."""
    mine, theirs = time_to_target(ours, target), time_to_target(peer, target)
    if mine is None:
        ratio, bound, time_ok = None, "", False
    elif theirs is None:
        ratio, bound = mine[1] / peer.train_s, "<= "
        time_ok = ratio <= time_target
    else:
        ratio, bound = mine[1] / theirs[1], ""
        time_ok = ratio <= time_target
    accuracy_ok = ours.final_accuracy >= peer.final_accuracy - tolerance
    return {"ours": mine, "peer": theirs, "ratio": ratio, "bound": bound, "time_ok": time_ok,
            "accuracy_ok": accuracy_ok}


def _reach(hit: tuple[int, float] | None, curve: Curve) -> str:
    return f"{hit[1]:.1f} s (step {hit[0]})" if hit else f"not reached in {curve.steps} steps"


def table(ours: Curve, peer: Curve, base: float, target: float, tolerance: float = TOLERANCE) -> list[str]:
    """The markdown rows: verdicts first, then the times around them, then the curves."""
    v = verdict(ours, peer, target, tolerance)
    ratio = f"{v['bound']}{v['ratio']:.2f}x" if v["ratio"] is not None else "n/a"
    ok = {True: "PASS", False: "FAIL"}
    lines = [
        f"| metric | {ours.name} | {peer.name} | {ours.name} / {peer.name} | target | result |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        f"| training time to held-out accuracy >= {target:.3f} (base {base:.3f} + {target - base:.2f}) | "
        f"{_reach(v['ours'], ours)} | {_reach(v['peer'], peer)} | {ratio} | <= {TIME_TARGET}x | {ok[v['time_ok']]} |",
        f"| final held-out accuracy ({ours.steps} steps) | {ours.final_accuracy:.3f} | {peer.final_accuracy:.3f} | "
        f"{100 * (ours.final_accuracy - peer.final_accuracy):+.1f} points | >= {peer.name} - {100 * tolerance:.0f} "
        f"points | {ok[v['accuracy_ok']]} |",
        f"| training time, all {ours.steps} steps | {ours.train_s:.1f} s | {peer.train_s:.1f} s | "
        f"{ours.train_s / peer.train_s:.2f}x | | |",
        f"| seconds per step | {ours.train_s / ours.steps:.2f} | {peer.train_s / peer.steps:.2f} | | | |",
        f"| start-up (processes, model, job) | {ours.startup_s:.1f} s | {peer.startup_s:.1f} s | | | |",
        f"| total wall time (start-up + loop, incl. evaluations and saves) | {ours.total_s:.1f} s | "
        f"{peer.total_s:.1f} s | {ours.total_s / peer.total_s:.2f}x | | |",
        "",
        f"| step | {ours.name} training s | {ours.name} held-out acc | {peer.name} training s | "
        f"{peer.name} held-out acc |",
        "| ---: | ---: | ---: | ---: | ---: |",
        f"| 0 | 0.0 | {base:.3f} | 0.0 | {base:.3f} |",
    ]
    theirs = {step: (s, acc) for step, s, acc in peer.points}
    for step, seconds, acc in ours.points:
        other = theirs.get(step)
        right = f"{other[0]:.1f} | {other[1]:.3f}" if other else " | "
        lines.append(f"| {step} | {seconds:.1f} | {acc:.3f} | {right} |")
    return lines


# ------------------------------------------------------------------------------------------ running


def trl_spec(cfg: Any, threads: int, export_every: int) -> dict[str, Any]:
    """The lorarl job's settings and its exact prompt stream, for bench/trl_grpo.py."""
    from lorarl.client.job.datasets import TrainStream, load_examples

    train = load_examples(cfg.data.source, "train", cfg.data.train_path)
    examples = TrainStream(train, cfg.data.seed).take(cfg.loop.steps * cfg.loop.prompts_per_step)
    t, r = cfg.trainer, cfg.rollout
    return {
        "model_path": str(Path(cfg.model.path).resolve()), "reward": cfg.data.reward, "threads": threads,
        "examples": [[e.prompt, e.answer] for e in examples], "steps": cfg.loop.steps,
        "prompts_per_step": cfg.loop.prompts_per_step, "group_size": r.group_size, "max_tokens": r.max_tokens,
        "temperature": r.temperature, "top_p": r.top_p, "seed": t.seed, "learning_rate": t.optimizer.learning_rate,
        "weight_decay": t.optimizer.weight_decay, "max_grad_norm": t.optimizer.max_grad_norm,
        "rank": t.lora.rank, "alpha": t.lora.alpha, "dropout": t.lora.dropout,
        "target_modules": list(t.lora.target_modules), "loss_type": t.loss.type, "kl_coef": t.loss.kl_coef,
        "clip_eps_low": t.loss.clip_eps_low, "clip_eps_high": t.loss.clip_eps_high, "export_every": export_every,
    }


def run_trl(spec: dict[str, Any], out: Path, timeout_s: float | None = None) -> dict[str, Any] | None:
    """bench/trl_grpo.py in its own process; None if it ran past ``timeout_s`` (then it is killed)."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = out / "spec.json", out / "result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with (out / "trl.log").open("w") as log:
        try:
            done = subprocess.run([sys.executable, str(ROOT / "bench" / "trl_grpo.py"), str(spec_path),
                                   str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
    if done.returncode != 0:
        raise RuntimeError(f"TRL run failed ({done.returncode}):\n{(out / 'trl.log').read_text()[-3000:]}")
    result = json.loads(result_path.read_text())
    result["total_s"] = time.perf_counter() - started
    return result


def curve(name: str, train_s_at_step: dict, adapters: dict, accuracy: dict[str, float], startup_s: float,
          total_s: float) -> Curve:
    seconds = {int(k): v for k, v in train_s_at_step.items()}
    points = [(int(step), seconds[int(step)], accuracy[path]) for step, path in
              sorted(adapters.items(), key=lambda kv: int(kv[0]))]
    return Curve(name, points, startup_s, total_s)


def setup_line(cfg: Any, args: argparse.Namespace, trl_threads: list[int], started_load: float) -> str:
    import peft
    import torch
    import transformers
    import trl
    import vllm

    r, t = cfg.rollout, cfg.trainer
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, shared (load average {started_load:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end); torch {torch.__version__}, transformers {transformers.__version__},"
            f" peft {peft.__version__}, trl {trl.__version__}, vllm {vllm.__version__}. Job: {args.config} "
            f"({cfg.loop.steps} steps, {cfg.loop.prompts_per_step} prompts x {r.group_size} samples, "
            f"{r.max_tokens} new tokens at temperature {r.temperature:g}, LoRA r{t.lora.rank}/alpha {t.lora.alpha:g} "
            f"{','.join(t.lora.target_modules)}, lr {t.optimizer.learning_rate:g} constant, {t.loss.type} loss, "
            f"clip {t.loss.clip_eps_low:g}, KL {t.loss.kl_coef:g}, grad-norm cap {t.optimizer.max_grad_norm:g}, "
            f"reward {cfg.data.reward}). lorarl: {cfg.loop.mode} loop, three service processes with one OpenMP "
            f"thread each, vLLM rollout; TRL {trl.__version__}: GRPOTrainer + PEFT LoraConfig, HF generate, "
            f"one process, one run per torch thread count ({', '.join(map(str, trl_threads))}); "
            f"{args.rounds} round(s) of lorarl then TRL, one run after the other. Adapters saved every "
            f"{args.export_every} steps and scored afterwards by one rollout service (greedy, "
            f"{r.eval_max_tokens} tokens, {cfg.data.eval_size or 'all'} held-out problems); training time excludes "
            "saves and evaluations.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/demo.yaml")
    parser.add_argument("--steps", type=int, default=None, help="default: the config's loop.steps (40)")
    parser.add_argument("--prompts-per-step", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--mode", choices=["sync", "async"], default=None, help="lorarl loop mode (config's: async)")
    parser.add_argument("--export-every", type=int, default=5, help="save and score the adapters every K steps")
    parser.add_argument("--target-gain", type=float, default=TARGET_GAIN, help="target = base accuracy + this")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="final-accuracy tolerance (fraction)")
    parser.add_argument("--threads", default=f"{os.cpu_count() or 2},1",
                        help="TRL's torch threads, one TRL run per value; the faster run is the peer")
    parser.add_argument("--rounds", type=int, default=2,
                        help="lorarl and TRL runs alternate this many times; each side's fastest run is compared")
    parser.add_argument("--trl-timeout", type=float, default=1800.0, help="stop a TRL run after this many seconds")
    parser.add_argument("--out", default="runs/bench-trl-vs-lorarl")
    parser.add_argument("--quick", action="store_true", help="4 steps, 4 prompts x 8, scores every 2; no RESULTS.md")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompts_per_step, args.export_every = args.steps or 4, args.prompts_per_step or 4, 2
        args.rounds = 1
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        import trl  # noqa: F401
    except ImportError:
        print("trl is not installed: run `make bench-setup` first", file=sys.stderr)
        return 2

    from bench.lorarl_job import evaluate_adapters, run_job
    from lorarl.client.job.config import load_job_config

    out = ROOT / args.out
    overrides = ["output.tensorboard=false", "loop.eval_every=0", "job_id=bench-lorarl"]
    for key, value in (("loop.steps", args.steps), ("loop.prompts_per_step", args.prompts_per_step),
                       ("rollout.group_size", args.group_size), ("loop.mode", args.mode)):
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = load_job_config(str(ROOT / args.config), [f"output.dir={out / 'lorarl'}", *overrides])
    load_start = os.getloadavg()[0]

    ours_runs: list[tuple[Any, float]] = []  # (JobTiming, wall seconds) per round
    peer_runs: list[tuple[int, dict[str, Any]]] = []  # (torch threads, TRL result) per round and thread count
    stopped: list[str] = []
    thread_counts = [int(x) for x in args.threads.split(",")]
    for round_ in range(args.rounds):
        suffix = f"-{round_ + 1}" if args.rounds > 1 else ""
        run_cfg = load_job_config(str(ROOT / args.config), [f"output.dir={out / ('lorarl' + suffix)}", *overrides])
        print(f"lorarl{suffix}: {cfg.loop.mode} loop, {cfg.loop.steps} steps ...", flush=True)
        started = time.perf_counter()
        timing = run_job(run_cfg, out / f"lorarl{suffix}", export_every=args.export_every)
        ours_runs.append((timing, time.perf_counter() - started))
        print(f"lorarl{suffix}: start-up {timing.startup_s:.1f} s, loop {timing.loop_s:.1f} s "
              f"(training {timing.train_s:.1f} s)", flush=True)
        for threads in thread_counts:
            print(f"TRL{suffix}: GRPOTrainer, {cfg.loop.steps} steps, {threads} torch threads ...", flush=True)
            result = run_trl(trl_spec(cfg, threads, args.export_every), out / f"trl-{threads}threads{suffix}",
                             args.trl_timeout)
            if result is None:
                stopped.append(f"TRL with {threads} torch threads did not finish within {args.trl_timeout:.0f} s "
                               "and was stopped")
                print(f"TRL: {stopped[-1]}", flush=True)
                continue
            peer_runs.append((threads, result))
            print(f"TRL{suffix}: start-up {result['startup_s']:.1f} s, training {result['train_s']:.1f} s",
                  flush=True)
    if not peer_runs:
        print("no TRL run finished", file=sys.stderr)
        return 1

    print("scoring the adapters ...", flush=True)
    adapters = [None, *(a for t, _ in ours_runs for a in t.adapters.values()),
                *(a for _, p in peer_runs for a in p["adapters"].values())]
    scores = evaluate_adapters(cfg, out / "eval", adapters)
    accuracy = dict(zip([str(a) for a in adapters], scores, strict=True))
    base = accuracy["None"]
    target = base + args.target_gain
    our_curves = [curve("lorarl", t.train_s_at_step, t.adapters, accuracy, t.startup_s, wall) for t, wall in ours_runs]
    fastest = min(range(len(ours_runs)), key=lambda i: ours_runs[i][0].train_s)
    ours, mine = ours_runs[fastest][0], our_curves[fastest]
    curves = [curve(f"TRL ({n} thread{'s' if n > 1 else ''})", p["train_s_at_step"], p["adapters"], accuracy,
                    p["startup_s"], p["total_s"]) for n, p in peer_runs]
    theirs = min(curves, key=lambda c: c.train_s)
    rows = table(mine, theirs, base, target, args.tolerance)
    groups: dict[str, list[Curve]] = {"lorarl": our_curves}
    for c in curves:
        groups.setdefault(c.name, []).append(c)
    runs = [f"{name}: training {', '.join(f'{c.train_s:.1f}' for c in group)} s, time to target "
            f"{', '.join(_reach(time_to_target(c, target), c) for c in group)}, final held-out accuracy "
            f"{', '.join(f'{c.final_accuracy:.3f}' for c in group)}" for name, group in groups.items()]
    rows += ["", f"Every run, in round order ({args.rounds} round(s); the table compares each side's fastest): "
             + "; ".join([*runs, *stopped]) + "."]
    loop_check = (f"Cross-check: lorarl's own in-loop evaluation after the last step read "
                  f"{ours.final_accuracy:.3f}; the shared evaluator read {mine.final_accuracy:.3f} for the same "
                  f"adapter.")
    body = [setup_line(cfg, args, thread_counts, load_start), "", *rows, "", loop_check, "",
            "Settings that could not be matched: " + "; ".join(_unmatched()) + ".", "",
            f"Command: `.venv/bin/python bench/trl_vs_lorarl.py{_suffix(args)}`"]
    print("\n".join(body))
    (out / "table.md").write_text("\n".join(body) + "\n")
    if not (args.quick or args.no_write):
        from bench.results import write_results

        write_results(HEADING, f"### cpu, {cfg.loop.mode} lorarl, {cfg.loop.steps} steps, "
                               f"{cfg.loop.prompts_per_step} x {cfg.rollout.group_size}", body)
    return 0


def _unmatched() -> list[str]:
    from bench.trl_grpo import UNMATCHED

    return UNMATCHED


def _suffix(args: argparse.Namespace) -> str:
    if args.quick:
        return " --quick"
    parts = []
    for flag, value in (("--steps", args.steps), ("--prompts-per-step", args.prompts_per_step),
                        ("--group-size", args.group_size), ("--mode", args.mode)):
        if value is not None:
            parts.append(f" {flag} {value}")
    if args.export_every != 5:
        parts.append(f" --export-every {args.export_every}")
    if args.threads != f"{os.cpu_count() or 2},1":
        parts.append(f" --threads {args.threads}")
    if args.rounds != 2:
        parts.append(f" --rounds {args.rounds}")
    return "".join(parts)


if __name__ == "__main__":
    sys.exit(main())
