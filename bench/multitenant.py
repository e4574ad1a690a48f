"""Many jobs, one base: N LoRA jobs in one trainer process on one resident base vs N trainer processes.

A random-init model at the Qwen3-0.6B layer shape (``--layers`` decoder layers, the real 151,936-token
vocabulary, fp32) is built once. For each N in ``--jobs``:

- shared: one process, N jobs in one trainer JobManager (lorarl.trainer.service.jobs), ranks ``--ranks`` in
  turn, on one resident base (lorarl.trainer.engines.torch.shared_base): created as CreateJob creates them, then
  trained at once as the trainer service trains them (each job's engine thread, turns at the base by weighted
  fair share, one malloc arena from the second job on).
- separate: N processes, one JobManager with one job each, training at the same time.

Each side gets the same ``--cpus`` (default: all): the shared process computes with that many torch threads,
each separate process with ``cpus // N`` (at least 1). (Until commit d90d630 both ran one thread per process,
so N >= 2 separate processes used every core while the shared one used one.)

Both run the same GRPO steps (``--steps`` after one warm-up, ``--groups`` x ``--group-size`` completions of
``--completion-tokens`` random tokens on a ``--prompt-tokens`` prompt) and report: peak RSS (the sum over the
processes for separate), aggregate trained tokens/s, each shared job's step time (median seconds from its call
to its answer: its wait for a turn and its compute; the timed steps start together) and their fairness (max/min
across the jobs: the jobs' ranks differ, so tokens/s would differ at equal turns, while equal-weight turns give
every job the same step time), the time
to add a job to a resident base, and the time to read one job's adapter for publishing. Each configuration
runs in fresh processes; the table goes into bench/RESULTS.md.

    .venv/bin/python bench/multitenant.py
    .venv/bin/python bench/multitenant.py --quick          # the shipped tiny model, N = 1, 2 (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Trainer: many jobs on one base"


def batch(args: argparse.Namespace, seed: int, version: int) -> list:
    import random

    from lorarl.trainer.engines.api import TrajectoryRecord

    rng = random.Random(seed)
    vocab = min(30000, json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    out = []
    for g in range(args.groups):
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
        for _ in range(args.group_size):
            n = args.completion_tokens
            out.append(TrajectoryRecord(prompt, [rng.randrange(10, vocab) for _ in range(n)],
                                        [-rng.uniform(1.0, 6.0) for _ in range(n)], [version] * n,
                                        float(rng.randint(0, 1)), f"g{seed}-{g}"))
    return out


def spec(args: argparse.Namespace, job: int):
    from lorarl.trainer.engines.api import LossSpec, OptimizerSpec, TrainingSpec
    from lorarl.trainer.rl.lora import LoraConfig

    rank = args.ranks[job % len(args.ranks)]
    return TrainingSpec(base_model_path=args.model, lora=LoraConfig(rank=rank, alpha=2 * rank), loss=LossSpec(),
                        optimizer=OptimizerSpec(learning_rate=1e-4), seed=job)


async def train(manager, args: argparse.Namespace, job: int, out: dict, together=None) -> None:
    """One job's warm-up step, then ``args.steps`` timed ones, through the trainer's JobManager; ``together`` (an
    asyncio.Barrier): the timed steps start when every job has warmed up."""
    name = f"job{job}"
    engine = manager.get(name).engine
    await manager.train_step(name, 0, batch(args, 1000 * job, engine.version))  # warm-up step: not timed
    if together is not None:
        await together.wait()
    start, tokens, step_s, ends = time.time(), 0, [], []
    for step in range(args.steps):
        records = batch(args, 1000 * job + step + 1, engine.version)
        called = time.perf_counter()
        await manager.train_step(name, 0, records)
        step_s.append(time.perf_counter() - called)  # its wait for a turn and its own compute
        ends.append(time.time())
        tokens += sum(len(r.completion_token_ids) for r in records)
    end = time.time()
    out[job] = {"rate": tokens / (end - start), "start": start, "end": end, "step_s": statistics.median(step_s),
                "ends": ends}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_shared(args: argparse.Namespace) -> dict:
    """N jobs on one base in one trainer's JobManager (lorarl.trainer.service.jobs), as the trainer service runs
    them: created one after another (CreateJob's work: engine and warm-up), then trained at once, each job's
    calls on its own engine thread, the turns at the base by weighted fair share."""
    import asyncio

    from lorarl.trainer.service.jobs import JobManager

    manager = JobManager(max_jobs=max(4, args.n))
    runs: dict[int, dict] = {}

    async def scenario() -> list[float]:
        add_s = []
        for job in range(args.n):
            start = time.perf_counter()
            await manager.create(f"job{job}", spec(args, job))
            add_s.append(time.perf_counter() - start)
        together = asyncio.Barrier(args.n)
        await asyncio.gather(*(train(manager, args, j, runs, together) for j in range(args.n)))
        return add_s

    add_s = asyncio.run(scenario())
    engines = [manager.get(f"job{j}").engine for j in range(args.n)]
    wall = max(r["end"] for r in runs.values()) - min(r["start"] for r in runs.values())
    publish = time.perf_counter()
    _ = [(n, t.detach().clone()) for n, t in engines[-1].iter_adapter_tensors()]
    publish_s = time.perf_counter() - publish
    tokens = args.steps * args.groups * args.group_size * args.completion_tokens * args.n
    first_done = min(r["ends"][-1] for r in runs.values())  # until then every job was training
    return {"rss": peak_rss_bytes(), "tokens_per_s": tokens / wall, "rates": [r["rate"] for r in runs.values()],
            "step_s": [r["step_s"] for r in runs.values()], "first_job_s": add_s[0],
            "window_steps": [sum(e <= first_done for e in r["ends"]) for r in runs.values()],
            "add_job_s": max(add_s[1:], default=0.0), "publish_s": publish_s,
            "base_bytes": engines[0].memory()[0], "job_bytes": engines[-1].memory()[2]}


def worker_one(args: argparse.Namespace) -> dict:
    """One job alone in this process (one of N separate trainer processes), through its own JobManager."""
    import asyncio

    from lorarl.trainer.service.jobs import JobManager

    manager = JobManager()
    runs: dict[int, dict] = {}

    async def scenario() -> None:
        await manager.create(f"job{args.job}", spec(args, args.job))
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # all loaded: start together
        await train(manager, args, args.job, runs)

    asyncio.run(scenario())
    return {"rss": peak_rss_bytes(), **runs[args.job]}


def run_worker(args: argparse.Namespace, threads: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps), "--groups",
               str(args.groups), "--group-size", str(args.group_size), "--prompt-tokens", str(args.prompt_tokens),
               "--completion-tokens", str(args.completion_tokens), "--ranks", *map(str, args.ranks), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


#: The fairness run: equal jobs (one rank, one weight) of small steps, many of them, so that the steps each job
#: finished while all were training (turn by turn) resolve a share to within one step in twelve.
FAIR_STEPS = ("--steps", "12", "--groups", "1", "--group-size", "2", "--completion-tokens", "64")


def measure(args: argparse.Namespace, n: int) -> tuple[dict, dict]:
    shared = run_worker(args, args.cpus, "--worker", "shared", "--n", str(n))
    out, _ = shared.communicate(timeout=3600)
    shared_result = last_json(out)
    if n > 1:
        fair = run_worker(args, args.cpus, "--worker", "shared", "--n", str(n), *FAIR_STEPS,
                          "--ranks", str(args.ranks[0]))
        shared_result["fair_steps"] = last_json(fair.communicate(timeout=3600)[0])["window_steps"]
    procs = [run_worker(args, max(1, args.cpus // n), "--worker", "one", "--job", str(j)) for j in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [last_json(p.communicate(timeout=3600)[0]) for p in procs]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = args.steps * args.groups * args.group_size * args.completion_tokens * n
    separate = {"rss": sum(r["rss"] for r in results), "tokens_per_s": tokens / wall,
                "rates": [r["rate"] for r in results]}
    return shared_result, separate


def fairness(values: list[float]) -> float:
    """max/min across the jobs (1.0: every job alike)."""
    return max(values) / min(values) if values and min(values) > 0 else float("nan")


def table(args: argparse.Namespace, rows: list[tuple[int, dict, dict]]) -> list[str]:
    gib = 2**30
    lines = [f"Model: {args.shape}, ranks {args.ranks} in turn; {args.steps} timed GRPO steps of {args.groups} x "
             f"{args.group_size} completions x {args.completion_tokens} tokens (prompt {args.prompt_tokens}) "
             "per job. Shared: one trainer JobManager, the jobs taking turns on the base by fair share; separate: "
             f"one process per job, all at once. Each side on {args.cpus} CPUs: the shared process with "
             f"{args.cpus} torch threads, each separate process with {args.cpus} // jobs (at least 1). Fairness: "
             f"a second shared run of equal jobs (rank {args.ranks[0]}, weight 1) of 12 small steps each (1 x 2 x 64 "
             "tokens), the steps each job finished while all were training (until the first was done).", "",
             "| jobs | peak RSS shared | peak RSS separate | shared / separate | tokens/s shared | tokens/s "
             "separate | shared / separate | step s shared (per job, median) | fairness: steps of equal jobs "
             "(max/min) | add a job (CreateJob, resident base) | read an adapter to publish |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, shared, separate in rows:
        lines.append(
            f"| {n} | {shared['rss'] / gib:.2f} GiB | {separate['rss'] / gib:.2f} GiB | "
            f"{shared['rss'] / separate['rss']:.2f} | {shared['tokens_per_s']:.0f} | {separate['tokens_per_s']:.0f} "
            f"| {shared['tokens_per_s'] / separate['tokens_per_s']:.2f} | "
            f"{min(shared['step_s']):.2f} - {max(shared['step_s']):.2f} | "
            + (f"{min(shared['fair_steps'])} - {max(shared['fair_steps'])} ({fairness(shared['fair_steps']):.2f}) | "
               if n > 1 else "- | ")
            + (f"{shared['add_job_s'] * 1000:.0f} ms" if n > 1 else "-")
            + f" | {shared['publish_s'] * 1000:.1f} ms |")
    base, job = rows[-1][1]["base_bytes"], rows[-1][1]["job_bytes"]
    lines += ["", f"Base {base / gib:.2f} GiB resident once; one job's own bytes before its first step "
              f"{job / 2**20:.1f} MiB (adapter; x3 more for gradients and Adam moments once it trains). First "
              f"job (loads the base): {rows[-1][1]['first_job_s']:.1f} s."]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs each side computes on")
    parser.add_argument("--quick", action="store_true", help="the shipped tiny model, N = 1, 2, one step")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["shared", "one"], help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        print(json.dumps(worker_shared(args) if args.worker == "shared" else worker_one(args)), flush=True)
        return 0
    if args.quick:
        args.jobs, args.steps, args.groups, args.group_size = [1, 2], 1, 1, 2
        args.prompt_tokens, args.completion_tokens = 8, 8
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.model, args.shape = str(ROOT / "lorarl/assets/models/qwen3-tiny"), "the shipped tiny Qwen3"
        else:
            from lorarl.assets.models import build_random_model

            args.model = str(Path(tmp) / "model")
            build_random_model("qwen3-0.6b", Path(args.model), num_layers=args.layers,
                               dtype=__import__("torch").float32)
            args.shape = f"Qwen3-0.6B shape, {args.layers} layers, vocabulary 151,936, fp32 (random init)"
        rows = [(n, *measure(args, n)) for n in args.jobs]
    body = table(args, rows)
    print("\n".join(body))
    if not (args.quick or args.no_write):
        from bench.results import write_results

        write_results(HEADING, f"### {len(args.jobs)} sizes, N = {', '.join(map(str, args.jobs))}", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
