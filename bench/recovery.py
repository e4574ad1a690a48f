"""Time to detect and to recover from each fault of `lorarl run`, one SIGKILL after another; and a campaign
of trainer kills in the async loop, where a kill can land anywhere in overlapping steps.

    python bench/recovery.py [--steps 14] [--out runs/bench-recovery]
    python bench/recovery.py --campaign 20 [--steps 30] [--seed 0]

One run of examples/demo.yaml (sync, so each step is short and the kill lands between known points);
at chosen steps it SIGKILLs, in turn, the trainer, the rollout, the rollout's vLLM engine core and
weight sync. Per fault it reports: seconds from the kill to the supervisor noticing (its "exited"
line), to the service serving again ("is back"), and to the next completed step in metrics.jsonl;
and how many steps were redone. The same harness drives the end-to-end fault test
(tests/e2e/test_faults.py), which asserts; this script measures and writes bench/RESULTS.md.

``--campaign N``: N runs of the default (async) demo, each SIGKILLing the trainer once, at a step drawn from
12..20 and 0-1 s after that step's row (so inside the next step's training, its publish, or generation of the
batches in flight); each run must end rc 0 with every step logged once and versions strictly rising.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
TARGETS = ("trainer", "rollout", "engine-core", "weightsync")


@dataclass
class Kill:
    target: str
    at_step: int  # killed once this many steps were logged
    delay_s: float = 0.0  # ... and this long after
    pid: int = 0
    due: float = 0.0
    killed_at: float = 0.0
    noticed_s: float | None = None  # the supervisor's "exited" line
    back_s: float | None = None  # the supervisor's "is back" line
    next_step_s: float | None = None  # the next step row in metrics.jsonl


@dataclass
class FaultRun:
    returncode: int
    kills: list[Kill]
    rows: list[dict]
    stderr: list[tuple[float, str]] = field(default_factory=list)
    stdout: str = ""

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.rows if "rollout/reward_mean" in r]

    def text(self) -> str:
        return self.stdout[-4000:] + "\n".join(line for _, line in self.stderr)[-6000:]


def read_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def service_pid(out: Path, name: str) -> int:
    return int(json.loads((out / "services" / f"{name}.ready.json").read_text())["pid"])


def engine_core_pid(rollout_pid: int) -> int:
    """vLLM's engine core: the rollout's child process."""
    import psutil

    def is_engine_core(child: psutil.Process) -> bool:  # not multiprocessing's resource tracker
        with contextlib.suppress(psutil.Error):
            return "EngineCore" in child.name() or not any("resource_tracker" in a for a in child.cmdline())
        return False

    children = [c for c in psutil.Process(rollout_pid).children(recursive=False) if is_engine_core(c)]
    if not children:
        raise RuntimeError(f"the rollout (pid {rollout_pid}) has no engine-core child process to kill")
    return children[0].pid


def target_pid(out: Path, target: str) -> int:
    if target == "engine-core":
        return engine_core_pid(service_pid(out, "rollout"))
    return service_pid(out, target)


def lorarl_command() -> list[str]:
    script = Path(sys.executable).with_name("lorarl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]


def run_with_faults(out: Path, kills: list[Kill], overrides: list[str], timeout_s: float = 900,
                    command: str = "run") -> FaultRun:
    """`lorarl run examples/demo.yaml` with ``overrides``; SIGKILLs each target once the run has logged
    ``at_step`` steps (the next kill waits for the previous fault's recovery: a new step)."""
    import psutil

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*lorarl_command(), command, "examples/demo.yaml", f"output.dir={out}", *overrides],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stderr: list[tuple[float, str]] = []
    stdout: list[str] = []

    def pump_err() -> None:
        for line in process.stderr:  # type: ignore[union-attr]
            stderr.append((time.monotonic(), line.rstrip("\n")))

    def pump_out() -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            stdout.append(line)

    threads = [threading.Thread(target=pump_err, daemon=True), threading.Thread(target=pump_out, daemon=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    pending = list(kills)
    try:
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            done = len([r for r in read_rows(out) if "rollout/reward_mean" in r])
            now = time.monotonic()
            for kill in kills:
                if kill.killed_at and kill.next_step_s is None and done > kill.at_step:
                    kill.next_step_s = now - kill.killed_at
            if pending and done >= pending[0].at_step and all(k.next_step_s is not None for k in kills
                                                              if k.killed_at):
                if not pending[0].due:
                    pending[0].due = now + pending[0].delay_s
                if now < pending[0].due:
                    continue
                kill = pending.pop(0)
                try:
                    kill.pid = target_pid(out, kill.target)
                    os.kill(kill.pid, signal.SIGKILL)
                    kill.killed_at = time.monotonic()
                except (OSError, RuntimeError, KeyError, ValueError, psutil.Error) as e:  # not up (yet): next poll
                    print(f"bench/recovery: could not kill {kill.target}: {e}", file=sys.stderr)
                    pending.insert(0, kill)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    for t in threads:
        t.join(timeout=10)
    for kill in kills:
        if not kill.killed_at:
            continue
        service = "rollout" if kill.target == "engine-core" else kill.target
        after = [(t, line) for t, line in stderr if t >= kill.killed_at]
        exited = next((t for t, line in after if f"the {service} service exited" in line), None)
        back = next((t for t, line in after if f"the {service} service is back" in line), None)
        kill.noticed_s = None if exited is None else exited - kill.killed_at
        kill.back_s = None if back is None else back - kill.killed_at
    return FaultRun(process.returncode, kills, read_rows(out), stderr, "".join(stdout))


def redone(run: FaultRun) -> int:
    """Steps that ran more than once: train rows logged and then rewound (the log keeps each step once)."""
    lines = "\n".join(line for _, line in run.stderr)
    return lines.count("recovering (fault")


def versions_rise(run: FaultRun, steps: int) -> bool:
    """Every step logged once, in order, and each under a version above the last one."""
    versions = [int(r["sync/version"]) for r in run.steps]
    return ([int(r["step"]) for r in run.steps] == list(range(1, steps + 1))
            and all(b > a for a, b in itertools.pairwise(versions)))


def campaign(args: argparse.Namespace, out: Path) -> int:
    """--campaign: N async runs, one trainer SIGKILL each at a drawn step and phase."""
    import random
    import shutil

    rng = random.Random(args.seed)
    rows, ok = [], 0
    for i in range(args.campaign):
        kill = Kill("trainer", rng.randint(12, 20), round(rng.uniform(0.0, 1.0), 2))
        where = out / f"run-{i:02d}"
        shutil.rmtree(where, ignore_errors=True)
        started = time.monotonic()
        run = run_with_faults(where, [kill], [f"loop.steps={args.steps}", "loop.eval_every=0", "data.eval_size=50",
                                              "output.tensorboard=false", "output.progress=false"], timeout_s=600)
        wall = time.monotonic() - started
        good = run.returncode == 0 and bool(kill.killed_at) and versions_rise(run, args.steps)
        ok += good
        trainer_log = where / "services" / "trainer.log"
        renumbered = trainer_log.read_text().count(" continues as ") if trainer_log.exists() else 0
        skipped = [int(b["sync/version"]) - int(a["sync/version"]) - 1 for a, b in itertools.pairwise(run.steps)]
        rows.append(f"| {i + 1} | {kill.at_step} + {kill.delay_s:.2f} s | {run.returncode} | {len(run.steps)} | "
                    f"{'yes' if versions_rise(run, args.steps) else 'NO'} | "
                    f"{'-' if kill.back_s is None else f'{kill.back_s:.1f}'} | {renumbered} | {sum(skipped)} | "
                    f"{wall:.0f} |")
        print(rows[-1], flush=True)
        if not good:
            print(run.text(), file=sys.stderr)
    body = [f"{ok} of {args.campaign} runs of `lorarl run examples/demo.yaml loop.steps={args.steps}` (async) ended "
            f"rc 0 with every step once and versions strictly rising, each through one SIGKILL of the trainer "
            f"(step drawn from 12..20, then 0-1 s into the next; seed {args.seed}); {os.cpu_count()} CPUs.", "",
            "| run | killed after step | rc | steps | versions rise | kill to trainer back (s) | trainer renumbered "
            "| version numbers skipped | wall (s) |",
            "|---|---|---|---|---|---|---|---|---|", *rows, "",
            "A restarted trainer resumes from the last resume point and, finding weight sync ahead of it, continues "
            "its versions above weight sync's latest (\"renumbered\"): numbers are skipped, never reused."]
    print("\n".join(body))
    if args.write:
        from bench.results import write_results

        write_results("## Fault recovery", f"### {args.campaign} trainer SIGKILLs in the async demo", body)
    return 0 if ok == args.campaign else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--out", default="runs/bench-recovery")
    parser.add_argument("--campaign", type=int, default=0, help="N async runs with one trainer SIGKILL each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="--campaign 2 --steps 8, nothing written")
    parser.add_argument("--no-write", dest="write", action="store_false", help="leave bench/RESULTS.md alone")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.quick:
        args.campaign, args.steps, args.write = 2, 16, False
    if args.campaign:
        return campaign(args, out)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    kills = [Kill(target, 2 + 3 * i) for i, target in enumerate(TARGETS)]
    started = time.monotonic()
    run = run_with_faults(out, kills, [f"loop.steps={args.steps}", "loop.mode=sync", "loop.eval_every=0",
                                       "data.eval_size=50", "output.tensorboard=false", "output.progress=false"])
    wall = time.monotonic() - started
    versions = [int(r["sync/version"]) for r in run.steps]
    def fmt(v):
        return ("not seen" if v is None else f"{v:.1f}")
    body = [f"`python bench/recovery.py --steps {args.steps}` on this machine ({os.cpu_count()} CPUs), "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: exit code {run.returncode}, "
            f"{len(run.steps)} of {args.steps} steps logged, wall {wall:.0f} s, versions {versions}.", "",
            "| SIGKILL of | at step | seen exited (s) | serving again (s) | next step done (s) |",
            "|---|---|---|---|---|"]
    for k in run.kills:
        body.append(f"| {k.target} | {k.at_step} | {fmt(k.noticed_s)} | {fmt(k.back_s)} | {fmt(k.next_step_s)} |")
    body += ["", f"Recoveries the loop made: {redone(run)} (each redoes the step in flight at most)."]
    print("\n".join(body))
    if run.returncode != 0:
        print(run.text(), file=sys.stderr)
        return 1
    from bench.results import write_results

    write_results("## Fault recovery", "### Four SIGKILLs in one `lorarl run` (demo, sync)", body)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
