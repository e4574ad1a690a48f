"""`lorarl run` start-up with vLLM's engine core forked (the rollout service's way on CPU) and spawned (vLLM's
CPU default, `VLLM_WORKER_MULTIPROC_METHOD=spawn`), side by side in one run.

Each run is the demo job for one sync step, evaluations off (examples/demo.yaml), at tensor parallel 1 and 2
(TP 2: merged weights, received in both workers, as tests/e2e/test_rl_loop.py runs it); the order alternates
fork, spawn, spawn, fork, ... so a drift of the shared machine hits both alike. Timed from the command's start:
"services up" (every service ready: the engine core, and at TP 2 its workers, up), and the whole command
(the step, the export and the shutdown included). Ratio = spawn / fork.

    .venv/bin/python bench/service_start.py            # 2 pairs at TP 1 and at TP 2
    .venv/bin/python bench/service_start.py --quick    # smoke test: 1 pair at TP 1, nothing written
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
#: The code this benchmark's figures depend on (bench/results.py): the whole system, run as `lorarl run` runs it.
MEASURES = ("lorarl",)
HEADING = "## lorarl run: start-up, vLLM's engine core forked or spawned"
TP2 = ["rollout.tensor_parallel_size=2", "sync.mode=merged", "rollout.enable_lora=true", "rollout.receive_in_worker=on"]


def run_once(method: str, tp: int, out: Path) -> dict[str, float]:
    """One `lorarl run` of one step; seconds to 'services up' and to the command's end."""
    shutil.rmtree(out, ignore_errors=True)
    script = Path(sys.executable).with_name("lorarl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    if method == "spawn":
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # the operator's setting, which the rollout keeps
    start = time.perf_counter()
    process = subprocess.Popen(
        [*command, "run", "--fresh", "examples/demo.yaml", f"output.dir={out}", "loop.mode=sync", "loop.steps=1",
         "loop.eval_every=0", "data.eval_size=8", "output.tensorboard=false", "output.progress=false",
         *(TP2 if tp == 2 else [])],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    up = None
    lines = []
    for line in process.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if up is None and line.startswith("lorarl: services up"):
            up = time.perf_counter() - start
    if process.wait() != 0 or up is None:
        raise RuntimeError(f"lorarl run ({method}, TP {tp}) failed:\n{''.join(lines)[-3000:]}")
    return {"up_s": up, "total_s": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", default="runs/bench-service-start")
    parser.add_argument("--quick", action="store_true", help="1 pair at TP 1; nothing written")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    sizes = (1,) if args.quick else (1, 2)
    pairs = 1 if args.quick else args.pairs
    load_start = os.getloadavg()[0]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for tp in sizes:
        for i in range(pairs):
            for method in ("fork", "spawn") if i % 2 == 0 else ("spawn", "fork"):
                result = run_once(method, tp, ROOT / args.out / f"{method}-tp{tp}-{i}")
                runs.setdefault((method, tp), []).append(result)
                print(f"TP {tp}, {method}: services up in {result['up_s']:.1f} s, command {result['total_s']:.1f} s",
                      flush=True)

    def mean(method: str, tp: int, key: str) -> float:
        return statistics.fmean(r[key] for r in runs[(method, tp)])

    rows = ["| tensor parallel | seconds to | forked (lorarl) | spawned (vLLM's CPU default) | spawn / fork |",
            "| ---: | --- | ---: | ---: | ---: |"]
    for tp in sizes:
        for key, what in (("up_s", "services up"), ("total_s", "the command's end (1 step)")):
            fork, spawn = mean("fork", tp, key), mean("spawn", tp, key)
            rows.append(f"| {tp} | {what} | {fork:.1f} | {spawn:.1f} | {spawn / fork:.2f}x |")
    each = "; ".join(f"{m} TP {tp}: " + ", ".join(f"{r['up_s']:.1f}/{r['total_s']:.1f}" for r in rs)
                     for (m, tp), rs in runs.items())
    setup = (f"{platform.machine()}, {os.cpu_count()} CPUs, shared (load average {load_start:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end). `lorarl run examples/demo.yaml` for one sync step, evaluations "
             f"off; TP 2 with merged weights received in both workers. {pairs} pair(s) per size, the order "
             f"alternating; means of the runs (each run's services-up/command seconds: {each}).")
    flags = " --quick" if args.quick else f" --pairs {args.pairs}" if args.pairs != 2 else ""
    body = [setup, "", *rows, "", f"Command: `.venv/bin/python bench/service_start.py{flags}`"]
    print("\n".join(body))
    if not (args.quick or args.no_write):
        from bench.results import write_results

        write_results(HEADING, f"### cpu, demo job, {os.cpu_count()} CPUs", body)
        print("written to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
