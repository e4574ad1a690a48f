"""`lorarl run` with and without CPU pinning (placement.pin_cpus auto / off), side by side in one run.

The demo job (examples/demo.yaml, evaluations off) runs through the `lorarl run` command itself, in
the order auto, off, off, auto, ... (``--pairs`` pairs, so a drift of the shared machine hits both
alike). Between the end of step ``--from-step`` and the end of ``--to-step`` the benchmark reads the
wall clock and every process's CPU time from /proc (trainer, weight sync, the rollout frontend, vLLM's
engine core, the loop itself), so a step's CPU cost per process shows where pinning saves. Speedup =
off / auto of the mean seconds per step (the best run of each is shown too).

    .venv/bin/python bench/cpu_pinning.py            # 3 pairs, steps 2-40 of the demo
    .venv/bin/python bench/cpu_pinning.py --quick    # smoke test: 1 pair, steps 2-6, nothing written
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
HEADING = "## lorarl run: CPU pinning"
PROCESSES = ("engine", "trainer", "rollout", "weightsync", "loop")


def _process_of(cmdline: str) -> str | None:
    if "EngineCore" in cmdline.split(" ")[0]:  # vLLM titles its engine-core process VLLM::EngineCore
        return "engine"
    for service in ("trainer", "rollout", "weightsync"):
        if f"serve {service}" in cmdline:
            return service
    return "loop" if " run " in cmdline and "lorarl" in cmdline else None


def cpu_seconds(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root_pid`` and its descendants, by process role."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        stats[int(entry.name)] = (cmdline, (int(fields[11]) + int(fields[12])) / tick)
    totals = dict.fromkeys(PROCESSES, 0.0)
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        if pid in stats:
            role = _process_of(stats[pid][0])
            if role is not None:
                totals[role] += stats[pid][1]
    return totals


def steps_done(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"train/step"' in line)
    except OSError:
        return 0


def run_once(pin: str, out: Path, first: int, last: int, steps: int) -> dict[str, float]:
    """One `lorarl run`; wall and CPU seconds per step between the end of step ``first`` and ``last``."""
    shutil.rmtree(out, ignore_errors=True)
    script = Path(sys.executable).with_name("lorarl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]
    process = subprocess.Popen(
        [*command, "run", "--fresh", "examples/demo.yaml", f"placement.pin_cpus={pin}", f"output.dir={out}",
         f"loop.steps={steps}", "loop.eval_every=0", "loop.checkpoint_every=0", "output.tensorboard=false"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    marks: list[tuple[float, dict[str, float]]] = []
    for target in (first, last):
        while steps_done(metrics) < target and process.poll() is None:
            time.sleep(0.01)
        marks.append((time.perf_counter(), cpu_seconds(process.pid)))
    if process.wait() != 0 or len(marks) < 2:
        raise RuntimeError(f"lorarl run (pin_cpus={pin}) failed; see {out / 'services'}")
    (t0, c0), (t1, c1) = marks
    n = last - first
    result = {"s_per_step": (t1 - t0) / n}
    result.update({role: (c1[role] - c0[role]) / n for role in PROCESSES})
    result["cpu_per_step"] = sum(result[role] for role in PROCESSES)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--from-step", type=int, default=2)
    parser.add_argument("--to-step", type=int, default=40)
    parser.add_argument("--out", default="runs/bench-cpu-pinning")
    parser.add_argument("--quick", action="store_true", help="1 pair, steps 2-6; nothing written")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.from_step, args.to_step = 1, 2, 6
    sys.path.insert(0, str(ROOT))
    from lorarl.client.job.config import load_job_config
    from lorarl.client.launch.services import cpu_pins

    pins = cpu_pins(load_job_config(str(ROOT / "examples/demo.yaml"), []))
    if not pins:
        print("nothing to compare: 'auto' pins nothing on this machine (one CPU?)", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = {"auto": [], "off": []}
    order = [("auto", "off") if i % 2 == 0 else ("off", "auto") for i in range(args.pairs)]
    for i, pair in enumerate(order):
        for pin in pair:
            result = run_once(pin, ROOT / args.out / f"{pin}-{i}", args.from_step, args.to_step, args.to_step)
            runs[pin].append(result)
            print(f"pair {i + 1}, pin_cpus={pin}: {result['s_per_step']:.3f} s/step, "
                  f"{result['cpu_per_step']:.3f} CPU-s/step", flush=True)

    def mean(pin: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs[pin])

    def best(pin: str) -> float:
        return min(r["s_per_step"] for r in runs[pin])

    rows = ["| per step (mean of runs) | pin_cpus: auto | pin_cpus: off | off / auto |", "| --- | ---: | ---: | ---: |",
            f"| wall seconds, best run | {best('auto'):.3f} | {best('off'):.3f} | {best('off') / best('auto'):.2f}x |",
            f"| wall seconds | {mean('auto', 's_per_step'):.3f} | {mean('off', 's_per_step'):.3f} | "
            f"{mean('off', 's_per_step') / mean('auto', 's_per_step'):.2f}x |",
            f"| CPU seconds, all processes | {mean('auto', 'cpu_per_step'):.3f} | {mean('off', 'cpu_per_step'):.3f} | "
            f"{mean('off', 'cpu_per_step') / mean('auto', 'cpu_per_step'):.2f}x |"]
    names = {"engine": "vLLM engine core", "trainer": "trainer", "rollout": "rollout frontend",
             "weightsync": "weight sync", "loop": "`lorarl run` (the loop)"}
    rows += [f"| CPU seconds, {names[role]} | {mean('auto', role):.3f} | {mean('off', role):.3f} | "
             f"{mean('off', role) / max(mean('auto', role), 1e-9):.2f}x |" for role in PROCESSES]
    each = "; ".join(f"{pin}: " + ", ".join(f"{r['s_per_step']:.3f}" for r in runs[pin]) for pin in runs)
    setup = (f"{platform.machine()}, {os.cpu_count()} CPUs, shared (load average {load_start:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end). `lorarl run examples/demo.yaml` (async, 16 x 8, evaluations "
             f"off), {args.pairs} pair(s) in the order auto/off, off/auto, ...; steps {args.from_step}-"
             f"{args.to_step} timed. 'auto' here: vLLM's engine core on CPUs {pins['rollout_engine']}, the trainer on "
             f"{pins['trainer']}, the rest unpinned. Seconds per step of every run: {each}.")
    flags = " --quick" if args.quick else f" --pairs {args.pairs}" if args.pairs != 3 else ""
    command = f"`.venv/bin/python bench/cpu_pinning.py{flags}`"
    body = [setup, "", *rows, "", f"Command: {command}"]
    print("\n".join(body))
    if not (args.quick or args.no_write):
        from bench.results import write_results

        write_results(HEADING, f"### cpu, demo job, {os.cpu_count()} CPUs", body)
        print("written to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
