"""Hours, not minutes: the default (async) demo for --steps steps with one service SIGKILLed every --restart-every
steps (trainer, rollout, vLLM engine core, weight sync in turn), every service process sampled as it runs.

    python bench/soak.py                                   # 1,000 steps, a kill per 100 (about 6 minutes here)
    python bench/soak.py --quick                           # 60 steps, a kill per 20, nothing written

Per service it reports resident memory, open files and threads over the run, and their slope per 1,000 steps
fitted within each process's life after its warm-up (the first --warmup steps of that life: a restart resets
the figures, which is not a trend); the run's disk use at the end (logs, checkpoints under
loop.keep_checkpoints, metrics); each service log against its retention (output.service_log_mib, set to
--log-mib here so that a run of minutes rotates what a run of days would: no file past the cap, no more copies
than output.service_log_backups); and that metrics.jsonl holds every step once under strictly rising versions.
Exit 1 if the run failed, a step is missing, a log outgrew its retention, or a slope is above --flat (a share of
the service's mean per 1,000 steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.recovery import TARGETS, FaultRun, Kill, run_with_faults, target_pid, versions_rise  # noqa: E402

#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
HEADING = "## Soak: the demo for 1,000 steps and more, with service restarts"
PROCESSES = ("trainer", "rollout", "engine-core", "weightsync")
MIB = 1 << 20


@dataclass
class Sample:
    process: str
    pid: int
    step: int
    rss: float  # MiB
    fds: int
    threads: int


def sample(out: Path, step: int) -> list[Sample]:
    import psutil

    found = []
    for name in PROCESSES:
        with contextlib.suppress(OSError, KeyError, ValueError, RuntimeError, psutil.Error):
            pid = target_pid(out, name)
            proc = psutil.Process(pid)
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE or not proc.memory_info().rss:
                    continue  # killed and not yet reaped: not a sample of a living process
                found.append(Sample(name, pid, step, proc.memory_info().rss / MIB, proc.num_fds(), proc.num_threads()))
    return found


def steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"rollout/reward_mean"' in line for line in path.read_text().splitlines())


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of value over steps, per 1,000 steps; None with under 3 points or one step."""
    if len(points) < 3 or len({s for s, _ in points}) < 2:
        return None
    return statistics.linear_regression([s for s, _ in points], [v for _, v in points]).slope * 1000


def lifetime_slopes(samples: list[Sample], field: str, warmup: int) -> float | None:
    """The slope within each process's life after its warm-up, weighted by the samples it rests on."""
    by_pid: dict[int, list[Sample]] = {}
    for s in samples:
        by_pid.setdefault(s.pid, []).append(s)
    fits = []
    for life in by_pid.values():
        start = life[0].step
        points = [(s.step, float(getattr(s, field))) for s in life if s.step >= start + warmup]
        if (fitted := slope(points)) is not None:
            fits.append((fitted, len(points)))
    if not fits:
        return None
    return sum(f * n for f, n in fits) / sum(n for _, n in fits)


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def disk(out: Path) -> dict[str, float]:
    def size(paths) -> float:
        return sum(p.stat().st_size for p in paths if p.is_file()) / MIB

    checkpoints = out / "checkpoints"
    return {"total": size(out.rglob("*")), "logs": size((out / "services").glob("*.log*")),
            "checkpoints": size(checkpoints.rglob("*")) if checkpoints.exists() else 0.0,
            "step checkpoints": float(len(list(checkpoints.glob("*/step-*")))) if checkpoints.exists() else 0.0,
            "metrics": size([out / "metrics.jsonl"]), "weightsync store": size((out / "weightsync").rglob("*"))}


#: What a file may pass its cap by: the output of one check interval (log_files.CHECK_INTERVAL_S) and more.
LOG_SLACK_BYTES = 256 << 10


def service_logs(out: Path, cap_bytes: int, backups: int) -> tuple[list[str], bool]:
    """Table rows of each service log (live file and its rotated copies) and whether all stay in retention."""
    rows, ok = [], True
    for log in sorted((out / "services").glob("*.log")):
        copies = sorted(log.parent.glob(f"{log.name}.*"), key=lambda p: p.name)
        copies = [c for c in copies if c.suffix.lstrip(".").isdigit()]
        largest = max(p.stat().st_size for p in [log, *copies])
        within = largest <= cap_bytes + LOG_SLACK_BYTES and len(copies) <= backups
        ok &= within
        total = sum(p.stat().st_size for p in [log, *copies])
        rows.append(f"| {log.stem} | {log.stat().st_size / 1024:.0f} | {len(copies)} | {largest / 1024:.0f} | "
                    f"{total / 1024:.0f} | {'yes' if within else 'NO'} |")
    return rows, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--restart-every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=80, help="steps of each process's life left out of its fit "
                                                               "(the engine core fills its LoRA slots and heap in ~80)")
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--flat", type=float, default=0.05, help="largest RSS slope, as a share of the mean, per "
                                                                 "1,000 steps")
    parser.add_argument("--log-mib", type=float, default=0.25, help="output.service_log_mib for the run (its "
                                                                       "default, 64, is reached in days, not minutes)")
    parser.add_argument("--log-backups", type=int, default=2, help="output.service_log_backups for the run")
    parser.add_argument("--out", default="runs/bench-soak")
    parser.add_argument("--quick", action="store_true", help="60 steps, a kill per 20, nothing written")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.restart_every, args.warmup, args.no_write = 60, 20, 5, True
    out = Path(args.out).resolve()
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    kills = [Kill(TARGETS[i % len(TARGETS)], at) for i, at in
             enumerate(range(args.restart_every, args.steps, args.restart_every))]
    overrides = [f"loop.steps={args.steps}", f"loop.eval_every={max(args.steps // 4, 1)}", "data.eval_size=50",
                 "loop.checkpoint_every=50", "loop.keep_checkpoints=3", "output.tensorboard=false",
                 "output.progress=false", f"output.service_log_mib={args.log_mib}",
                 f"output.service_log_backups={args.log_backups}"]  # recovery.* at defaults: they carry days
    result: list[FaultRun] = []
    runner = threading.Thread(target=lambda: result.append(run_with_faults(out, kills, overrides,
                                                                           timeout_s=args.steps * 10 + 600)))
    started = time.monotonic()
    runner.start()
    samples: list[Sample] = []
    while runner.is_alive():
        step = steps_done(out)
        if step < args.steps:  # after the last step the stack shuts down: not a sample of serving
            samples += sample(out, step)
        runner.join(timeout=args.sample_s)
    wall = time.monotonic() - started
    run = result[0]
    every_step = versions_rise(run, args.steps)
    ok = run.returncode == 0 and every_step and all(k.killed_at for k in kills)

    rows = []
    for name in PROCESSES:
        mine = [s for s in samples if s.process == name]
        if not mine:
            continue
        mean_rss = statistics.fmean(s.rss for s in mine)
        rss_slope = lifetime_slopes(mine, "rss", args.warmup)
        flat = rss_slope is not None and rss_slope <= args.flat * mean_rss  # shrinking is no leak
        ok &= flat
        rows.append(f"| {name} | {len({s.pid for s in mine})} | {min(s.rss for s in mine):.0f} - "
                    f"{max(s.rss for s in mine):.0f} | {fmt(rss_slope)} | {'flat' if flat else 'GROWS'} | "
                    f"{min(s.fds for s in mine)} - {max(s.fds for s in mine)} | "
                    f"{fmt(lifetime_slopes(mine, 'fds', args.warmup))} | "
                    f"{min(s.threads for s in mine)} - {max(s.threads for s in mine)} | "
                    f"{fmt(lifetime_slopes(mine, 'threads', args.warmup))} |")
    with (out / "soak-samples.jsonl").open("w") as f:  # the raw series, for a look at any process's curve
        f.writelines(json.dumps(vars(s)) + "\n" for s in samples)
    used = disk(out)
    cap = int(args.log_mib * MIB)
    log_rows, logs_kept = service_logs(out, cap, args.log_backups)
    ok &= logs_kept
    body = [f"`lorarl run examples/demo.yaml` (async) for {args.steps} steps, one SIGKILL every {args.restart_every} "
            f"steps ({', '.join(f'{k.target} at {k.at_step}' for k in kills)}); checkpoints every 50 steps, the "
            f"newest 3 kept; every service sampled every {args.sample_s:g} s ({len(samples)} samples), "
            f"{wall / 60:.1f} min in all. rc {run.returncode}; every step once under rising versions: "
            f"{'yes' if every_step else 'NO'}.", "",
            "| process | lives | RSS MiB (min - max) | RSS slope MiB / 1k steps | verdict | open files | files slope "
            "| threads | threads slope |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |", *rows, "",
            f"Service logs at the end, rotated at output.service_log_mib={args.log_mib:g} "
            f"({cap / 1024:.0f} KiB), output.service_log_backups={args.log_backups} (KiB; within: no file past the "
            f"cap by more than {LOG_SLACK_BYTES >> 10} KiB, no more copies than set):", "",
            "| log | live KiB | copies | largest file KiB | all KiB | within |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
            *log_rows, "",
            f"Disk at the end (MiB; the samples in {out.name}/soak-samples.jsonl): "
            + ", ".join(f"{k} {v:.1f}" if k != "step checkpoints" else f"{k} {v:.0f}" for k, v in used.items()) + ".",
            f"Slopes are fitted over each process's life after its first {args.warmup} steps and weighted by "
            f"samples; 'flat' means growing by at most {args.flat:.0%} of the mean RSS per 1,000 steps.",
            f"Verdict: {'PASS' if ok else 'FAIL'}."]
    print("\n".join(body))
    if not ok:
        print(run.text(), file=sys.stderr)
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### {args.steps} steps, a restart every {args.restart_every}", body)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
