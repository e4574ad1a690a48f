"""On-policy distillation against RL from scratch, side by side in one run (issue #47): two RL experts trained on
one task each of the demo's (examples/distill/expert-*.yaml), then a fresh student distilled from both
(examples/distill/student.yaml: each prompt scored by its task's expert, adapters in the student's own rollout
engine), and the same student trained by RL from scratch instead (the same job with loss grpo and no teachers),
for the same steps and the same 64 completions a step: the distilled student samples 64 prompts once each (its
advantage is per token, no group), RL 16 prompts 4 times each (its advantage needs the group). Each student twice,
on two data orders (data.seed 0 and 1). Per task and order: the expert's held-out accuracy, each student's, and the
first evaluated step at which each student reaches 90% of the expert.

    python bench/distill_vs_rl.py                   # ~6 minutes on 2 CPU cores
    python bench/distill_vs_rl.py --steps 20 --seeds 0 --no-write
"""

from __future__ import annotations

import argparse
import json
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
MEASURES = ("lorarl", "examples/distill")
HEADING = "## On-policy distillation from adapter teachers vs RL from scratch"
TASKS = ("sort", "add")
#: A student "reaches" an expert at this share of the expert's held-out accuracy (the issue's bar).
REACH = 0.9
QUIET = ["output.tensorboard=false", "output.progress=false", "--fresh"]
#: RL's samples per prompt (GRPO's group, the demo's); the distilled student takes the same samples a step as
#: prompts of one sample each.
RL_GROUP = 4


def lorarl() -> list[str]:
    script = Path(sys.executable).parent / "lorarl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]


def run(job: Path | str, *overrides: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([*lorarl(), "run", str(job), *overrides, *QUIET], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"lorarl run {job} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return time.perf_counter() - started


def evaluations(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/accuracy" in r]


def per_task(evals: list[dict], task: str) -> list[tuple[int, float]]:
    """(step, held-out accuracy on ``task``) at each evaluation of a two-task run."""
    key = f"eval/{task}/accuracy"
    return [(int(r["step"]), r[key]) for r in evals if key in r]


def first_reach(curve: list[tuple[int, float]], target: float) -> str:
    return next((str(step) for step, accuracy in curve if accuracy >= target), "-")


def student_job(tmp: Path, experts: dict[str, Path], steps: int, distil: bool, seed: int) -> Path:
    """examples/distill/student.yaml with the experts at ``experts`` and data order ``seed``; without ``distil``: the
    same job by RL (grpo, no teachers; 16 prompts x 4 samples a step: the distilled student's 64 completions as
    groups), its held-out accuracy per task reported all the same (data.eval_by: task)."""
    raw = yaml.safe_load((ROOT / "examples" / "distill" / "student.yaml").read_text())
    for teacher in raw["distill"]["teachers"]:
        teacher["adapter"] = str(experts[teacher["name"]])
    raw["loop"].update(steps=steps, eval_every=5, checkpoint_every=0)
    raw["data"].update(eval_by="task", seed=seed)
    name = f"{'distilled' if distil else 'rl'}-{seed}"
    raw["job_id"], raw["output"] = f"student-{name}", {"dir": str(tmp / name)}
    if not distil:
        samples = raw["loop"]["prompts_per_step"] * raw["rollout"]["group_size"]
        raw["trainer"]["loss"] = {"type": "grpo"}
        raw["distill"]["teachers"] = []
        raw["rollout"]["group_size"] = RL_GROUP
        raw["loop"]["prompts_per_step"] = samples // RL_GROUP
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="each student's steps (default 40)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="data orders (data.seed), each a run")
    parser.add_argument("--no-write", action="store_true", help="print, leave bench/RESULTS.md as it is")
    args = parser.parse_args(argv)
    labels = ("distilled", "rl")
    with tempfile.TemporaryDirectory(prefix="lorarl-distill-") as name:
        tmp = Path(name)
        experts, expert_score, expert_s = {}, {}, {}
        for task in TASKS:
            out = tmp / f"expert-{task}"
            expert_s[task] = run(f"examples/distill/expert-{task}.yaml", f"output.dir={out}")
            experts[task] = out / "exports" / f"expert-{task}" / "final-adapter"
            expert_score[task] = evaluations(out)[-1]["eval/accuracy"]  # its held-out rows are its task's only
            print(f"expert {task}: {expert_score[task]:.3f} held out ({expert_s[task]:.0f} s)", flush=True)
        walls: dict[tuple[str, int], float] = {}
        curves: dict[tuple[str, int], dict[str, list[tuple[int, float]]]] = {}
        for seed in args.seeds:
            for label in labels:
                walls[label, seed] = run(student_job(tmp, experts, args.steps, label == "distilled", seed))
                curves[label, seed] = {t: per_task(evaluations(tmp / f"{label}-{seed}"), t) for t in TASKS}
                print(f"student {label}, data.seed {seed}: {curves[label, seed]} ({walls[label, seed]:.0f} s)",
                      flush=True)
    body = ["| task | expert (40 steps) | data.seed | student distilled | reaches 90% at step | student by RL | "
            "reaches 90% at step |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
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
                     + ", ".join(str(s) for s, _ in c["sort"]) + ": "
                     + "; ".join(f"{t} " + " ".join(f"{a:.2f}" for _, a in c[t]) for t in TASKS) + "."]
    each = ", ".join(f"distilled {walls['distilled', s]:.0f} s and RL {walls['rl', s]:.0f} s (data.seed {s})"
                     for s in args.seeds)
    body += ["", f"Held-out greedy accuracy on each task's 150 test problems, evaluated every 5 steps; each student "
                 f"{args.steps} steps from a fresh adapter (sync loop), 64 completions a step: distilled 64 prompts x "
                 f"1 sample, RL 16 prompts x {RL_GROUP} samples. 'reaches 90%': the first evaluated step at or above "
                 f"0.9 x the expert's score. Whole commands: experts {expert_s['sort']:.0f} s and "
                 f"{expert_s['add']:.0f} s; students {each}; service start-up included."]
    print("\n".join(body))
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### {args.steps} student steps", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
