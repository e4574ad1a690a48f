"""On-policy distillation against RL from scratch, side by side in one run (issue #47): the two RL experts of
examples/multitenant trained on the shipped mixed base (`lorarl run sort.yaml tools.yaml`: digit sorting, single
turn, and the calculator agent, multi-turn through the rollout's OpenAI-compatible endpoint), then a fresh student
distilled from both (examples/distill/student.yaml: each row scored by its domain's expert, adapters in the
student's own rollout engine, the agent's chat turns scored there too), and the same student trained by RL from
scratch instead (the same job with loss grpo and no teachers), for the same steps and the same 64 episodes a step:
the distilled student runs 64 prompts once each (its advantage is per token, no group), RL 16 prompts 4 times each
(its advantage needs the group). Each student twice, on two data orders (data.seed 0 and 1). Per domain and order:
the expert's held-out accuracy, each student's, and the first evaluated step at which each student reaches 90% of
the expert.

    python bench/distill_vs_rl.py                   # ~25 minutes on 2 CPU cores
    python bench/distill_vs_rl.py --steps 20 --seeds 0 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes).
MEASURES = ("lorarl", "examples/distill", "examples/multitenant", "examples/calc_agent.py")
HEADING = "## On-policy distillation from adapter teachers vs RL from scratch"
TASKS = ("sort", "tools")
EXPERTS = ROOT / "examples" / "multitenant"
STUDENT = ROOT / "examples" / "distill" / "student.yaml"
#: The workflows' folders (a job's workflow is imported from its job file's folder: these jobs are copied out).
WORKFLOWS = (EXPERTS, STUDENT.parent)
#: A student "reaches" an expert at this share of the expert's held-out accuracy (the issue's bar).
REACH = 0.9
QUIET = ["output.tensorboard=false", "output.progress=false", "--fresh"]
#: RL's samples per prompt (GRPO's group, the demo's); the distilled student takes the same samples a step as
#: prompts of one sample each.
RL_GROUP = 4


def lorarl() -> list[str]:
    script = Path(sys.executable).parent / "lorarl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]


def run(*jobs: Path) -> float:
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, WORKFLOWS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*lorarl(), "run", *map(str, jobs), *QUIET], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"lorarl run exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return time.perf_counter() - started


def copied_job(source: Path, out: Path, job_id: str) -> dict:
    """``source`` as a dict, its model and data by absolute path, its output in ``out`` under ``job_id``."""
    raw = yaml.safe_load(source.read_text())
    raw["model"]["path"] = str(ROOT / raw["model"]["path"])
    for key in ("train_path", "test_path"):
        if key in raw["data"]:  # a jsonl job's (the shipped tasks need none)
            raw["data"][key] = str((source.parent / raw["data"][key]).resolve())
    raw["job_id"], raw["output"] = job_id, {"dir": str(out / job_id)}
    return raw


def write_job(raw: dict, out: Path) -> Path:
    path = out / f"{raw['job_id']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def evaluations(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/accuracy" in r]


def per_task(evals: list[dict], task: str) -> list[tuple[int, float, float]]:
    """(step, held-out accuracy on ``task``, the loop's seconds by then) at each evaluation of a two-domain run."""
    key = f"eval/{task}/accuracy"
    return [(int(r["step"]), r[key], float(r["time_s"])) for r in evals if key in r]


def first_reach(curve: list[tuple[int, float, float]], target: float) -> str:
    """'step (seconds)' of the first evaluation at or above ``target``; '-' when none is."""
    return next((f"{step} ({seconds:.0f} s)" for step, accuracy, seconds in curve if accuracy >= target), "-")


def student_job(tmp: Path, experts: dict[str, Path], steps: int, distil: bool, seed: int) -> Path:
    """examples/distill/student.yaml with the experts at ``experts`` and data order ``seed``; without ``distil``: the
    same job by RL (grpo, no teachers; 16 prompts x 4 episodes a step: the distilled student's 64 episodes as
    groups), its held-out accuracy per domain reported all the same (data.eval_by: task)."""
    name = f"{'distilled' if distil else 'rl'}-{seed}"
    raw = copied_job(STUDENT, tmp, name)
    for teacher in raw["distill"]["teachers"]:
        teacher["adapter"] = str(experts[teacher["name"]])
    raw["loop"].update(steps=steps, eval_every=5, checkpoint_every=0)
    raw["data"].update(eval_by="task", seed=seed)
    if not distil:
        samples = raw["loop"]["prompts_per_step"] * raw["rollout"]["group_size"]
        raw["trainer"]["loss"] = {"type": "grpo"}
        raw["distill"]["teachers"] = []
        raw["rollout"]["group_size"] = RL_GROUP
        raw["loop"]["prompts_per_step"] = samples // RL_GROUP
    return write_job(raw, tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="each student's steps (default 40)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="data orders (data.seed), each a run")
    parser.add_argument("--no-write", action="store_true", help="print, leave bench/RESULTS.md as it is")
    args = parser.parse_args(argv)
    labels = ("distilled", "rl")
    with tempfile.TemporaryDirectory(prefix="lorarl-distill-") as name:
        tmp = Path(name)
        # the two experts as the multitenant example trains them: one command, one stack, the first job's export
        # folder holding both adapters
        expert_s = run(*(write_job(copied_job(EXPERTS / f"{task}.yaml", tmp, task), tmp) for task in TASKS))
        experts = {task: tmp / TASKS[0] / "exports" / task / "final-adapter" for task in TASKS}
        expert_evals = {task: evaluations(tmp / task) for task in TASKS}  # each on its domain's rows only
        expert_score = {task: evals[-1]["eval/accuracy"] for task, evals in expert_evals.items()}
        for task in TASKS:  # an expert that collapsed (the agent did once in four runs: 0.87 -> 0 after step 25)
            start = expert_evals[task][0]["eval/accuracy"]  # makes a bar of 90% of nothing: no comparison
            if expert_score[task] <= start:
                raise SystemExit(f"expert {task} did not learn ({start:.3f} -> {expert_score[task]:.3f} held out): "
                                 "run the bench again")
        print(f"experts {expert_score} held out ({expert_s:.0f} s)", flush=True)
        walls: dict[tuple[str, int], float] = {}
        curves: dict[tuple[str, int], dict[str, list[tuple[int, float, float]]]] = {}
        for seed in args.seeds:
            for label in labels:
                walls[label, seed] = run(student_job(tmp, experts, args.steps, label == "distilled", seed))
                curves[label, seed] = {t: per_task(evaluations(tmp / f"{label}-{seed}"), t) for t in TASKS}
                print(f"student {label}, data.seed {seed}: {curves[label, seed]} ({walls[label, seed]:.0f} s)",
                      flush=True)
    body = ["| domain | expert (40 steps) | data.seed | student distilled | reaches 90% at step (s) | student by RL | "
            "reaches 90% at step (s) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for task in TASKS:
        target = REACH * expert_score[task]
        for seed in args.seeds:
            d, r = curves["distilled", seed][task], curves["rl", seed][task]
            body.append(f"| {task} | {expert_score[task]:.3f} | {seed} | {d[-1][1]:.3f} | {first_reach(d, target)} | "
                        f"{r[-1][1]:.3f} | {first_reach(r, target)} |")
    for label, title in (("distilled", "distilled"), ("rl", "by RL")):
        for seed in args.seeds:
            c = curves[label, seed]
            body += ["", f"Student {title}, data.seed {seed}, held out at steps "
                     + ", ".join(str(s) for s, _, _ in c["sort"]) + ": "
                     + "; ".join(f"{t} " + " ".join(f"{a:.2f}" for _, a, _ in c[t]) for t in TASKS) + "."]
    each = ", ".join(f"distilled {walls['distilled', s]:.0f} s and RL {walls['rl', s]:.0f} s (data.seed {s})"
                     for s in args.seeds)
    body += ["", f"Held-out greedy accuracy on each domain's whole test split (sort 150 problems, tools 200 agent "
                 f"episodes: lorarl.assets.mixed_task), evaluated every 5 steps; each student {args.steps} steps from "
                 f"a fresh adapter (sync loop), 64 episodes a step: distilled 64 prompts x 1, RL 16 prompts x "
                 f"{RL_GROUP}. 'reaches 90%': the first evaluated step at or above 0.9 x the expert's score, and "
                 f"the loop's seconds by then (service start-up not counted). Whole "
                 f"commands: both experts {expert_s:.0f} s (`lorarl run examples/multitenant/sort.yaml "
                 f"examples/multitenant/tools.yaml`, one stack); students {each}; service start-up included."]
    print("\n".join(body))
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### {args.steps} student steps", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
