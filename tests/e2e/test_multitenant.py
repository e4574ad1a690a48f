"""examples/multitenant end to end: `lorarl run add.yaml sort.yaml` — two jobs with their own tasks, LoRA ranks,
losses and rewards on one local stack. The trainer holds the base once for both (its log says so when the
jobs are created), the one rollout serves both jobs' adapters, and each job's held-out greedy accuracy
rises by at least 30 points (#31's bar). Then a job attached to a running `lorarl run` (`--attach`) trains on its
stack, and the owner keeps the services up until it ends."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from lorarl.client.launch.local import lorarl_command

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multitenant"


def job_file(tmp: Path, name: str) -> Path:
    """The example's job file with its output in ``tmp`` (and the model by absolute path)."""
    cfg = yaml.safe_load((EXAMPLE / f"{name}.yaml").read_text())
    cfg["output"]["dir"] = str(tmp / name)
    cfg["model"]["path"] = str(ROOT / cfg["model"]["path"])
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_two_jobs_on_one_base_both_learn(tmp_path: Path) -> None:
    files = [job_file(tmp_path, name) for name in ("add", "sort")]
    done = subprocess.run([*lorarl_command(), "run", *map(str, files), "output.tensorboard=false",
                           "output.progress=false", "--fresh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1100)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "services up for 2 jobs" in done.stdout and "add exited 0, sort exited 0" in done.stdout
    assert re.search(r"^\[add\] ", done.stdout, re.M) and re.search(r"^\[sort\] ", done.stdout, re.M)
    trainer_log = (tmp_path / "add" / "services" / "trainer.log").read_text()
    base = json.loads((ROOT / "lorarl/assets/models/qwen3-tiny/build_info.json").read_text())[
        "test_greedy_accuracy_per_task"]
    created = re.findall(r"job (\w+): created on base .*, resident once for (\d) job", trainer_log)
    # the second job found the first one's base resident (created together, both may count two)
    assert sorted(job for job, _ in created) == ["add", "sort"] and max(int(n) for _, n in created) == 2
    for name, task in (("add", "add"), ("sort", "sort")):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "eval/accuracy" in r]
        steps = [r for r in rows if "rollout/reward_mean" in r]
        print(f"{name}: held-out {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f} in "
              f"{evals[-1]['time_s']:.0f} s of loop")
        assert len(steps) == 40 and sorted(r["train/version"] for r in steps)[-1] == 40
        assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= 0.30, (name, evals)
        # evaluated on its own task only: the base's greedy accuracy on that task (0.36 over both)
        assert evals[0]["eval/accuracy"] == pytest.approx(base[task], abs=0.02), (name, base)


def test_a_job_attached_to_a_running_stack_trains_on_it(tmp_path: Path) -> None:
    add, sort = job_file(tmp_path, "add"), job_file(tmp_path, "sort")
    quiet = ["output.tensorboard=false", "output.progress=false"]
    owner = subprocess.Popen([*lorarl_command(), "run", str(add), "loop.steps=4", "rollout.max_loras=10",
                              "rollout.max_lora_rank=16", *quiet,
                              "--fresh"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((tmp_path / "add" / "services" / "stack.json").exists()
                   and (tmp_path / "add" / "config.json").exists()):
            assert owner.poll() is None and time.monotonic() < deadline, owner.communicate()
            time.sleep(0.5)
        # the lease the attached run takes when it starts, taken now for it: the owner's 4 steps cannot end
        # the stack while the attached process is still importing (it rewrites the lease, and drops it at exit)
        (tmp_path / "add" / "services" / "attached").mkdir(exist_ok=True)
        (tmp_path / "add" / "services" / "attached" / "sort").write_text(str(os.getpid()))
        attached = subprocess.run([*lorarl_command(), "run", str(sort), "--attach", str(tmp_path / "add"),
                                   "loop.steps=12", "recovery.wait_s=30", *quiet, "--fresh"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=600)
        out, err = owner.communicate(timeout=300)
    finally:
        if owner.poll() is None:
            owner.kill()
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr[-3000:] + out[-2000:] + err[-2000:]
    assert owner.returncode == 0, out[-3000:] + err[-3000:]
    assert "attached to the services of" in attached.stdout
    steps = [json.loads(line) for line in (tmp_path / "sort" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("train/version", 0) for r in steps) == 12
    # the owner's 4 steps end first: it says it waits for the attached job, which then ends on its services
    assert "the services stay up for the attached job(s) sort" in err
    created = re.findall(r"job (\w+): created on base", (tmp_path / "add" / "services" / "trainer.log").read_text())
    assert sorted(created) == ["add", "sort"]
