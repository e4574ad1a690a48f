"""examples/multitenant end to end, on one stack: `lorarl run add.yaml sort.yaml` — two jobs with their own
tasks, LoRA ranks, losses and rewards. The trainer holds the base once for all of them (its log says so when
the jobs are created), the one rollout serves every job's adapters, and each example job's held-out greedy
accuracy rises by at least 40 points (a healthy run: +50 and +49). While they run, a third job attaches to their stack
(`--attach`) and trains on it, and the owner keeps the services up until it ends. One stack for both checks:
starting a second one would cost the suite a minute (#29's budget)."""

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


def job_file(tmp: Path, name: str, job_id: str | None = None) -> Path:
    """The example's job file with its output in ``tmp`` (and the model by absolute path)."""
    cfg = yaml.safe_load((EXAMPLE / f"{name}.yaml").read_text())
    cfg["job_id"] = job_id or cfg["job_id"]
    cfg["output"]["dir"] = str(tmp / cfg["job_id"])
    cfg["model"]["path"] = str(ROOT / cfg["model"]["path"])
    path = tmp / f"{cfg['job_id']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_jobs_on_one_base_both_learn_and_a_third_attaches(tmp_path: Path) -> None:
    files = [job_file(tmp_path, name) for name in ("add", "sort")]
    late = job_file(tmp_path, "sort", job_id="late")
    quiet = ["output.tensorboard=false", "output.progress=false"]
    # adapter slots for a third staleness window (3 stale versions and the current one): room for the job
    # that attaches
    out_file, err_file = tmp_path / "owner.out", tmp_path / "owner.err"
    with out_file.open("w") as out_sink, err_file.open("w") as err_sink:
        owner = subprocess.Popen([*lorarl_command(), "run", *map(str, files), "rollout.max_loras=12", *quiet,
                                  "--fresh"], cwd=ROOT, stdout=out_sink, stderr=err_sink, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((tmp_path / "add" / "services" / "stack.json").exists()
                   and (tmp_path / "add" / "config.json").exists()):
            assert owner.poll() is None and time.monotonic() < deadline, err_file.read_text()[-3000:]
            time.sleep(0.5)
        # the lease the attached run takes when it starts, taken now for it: the owner's jobs cannot end the
        # stack while the attached process is still importing (it rewrites the lease, and drops it at exit)
        leases = tmp_path / "add" / "services" / "attached"
        leases.mkdir(exist_ok=True)
        (leases / "late").write_text(str(os.getpid()))
        # and one this test holds itself: whichever ends first, the owner's jobs or the attached one, the
        # owner must keep its services up (and say so) until this lease is dropped too
        (leases / "holder").write_text(str(os.getpid()))
        attached = subprocess.run([*lorarl_command(), "run", str(late), "--attach", str(tmp_path / "add"),
                                   "loop.steps=12", "loop.eval_every=0", "recovery.wait_s=30", *quiet, "--fresh"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=900)
        # the owner's own jobs end, and it says whom it waits for
        while "the services stay up for the attached" not in err_file.read_text():
            assert owner.poll() is None and time.monotonic() < deadline + 900, err_file.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(3)
        assert owner.poll() is None, "the owner stopped its services while a lease was held"
        (leases / "holder").unlink()
        owner.wait(timeout=300)
        out, err = out_file.read_text(), err_file.read_text()
    finally:
        if owner.poll() is None:
            owner.kill()
    assert owner.returncode == 0, out[-4000:] + err[-3000:]
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr[-3000:] + out[-2000:]
    assert "services up for 2 jobs" in out and "add exited 0, sort exited 0" in out
    assert re.search(r"^\[add\] ", out, re.M) and re.search(r"^\[sort\] ", out, re.M)
    assert "attached to the services of" in attached.stdout
    assert re.search(r"the services stay up for the attached job\(s\) (late, )?holder", err), err[-2000:]
    assert max(r.get("train/version", 0) for r in metrics(tmp_path / "late")) == 12

    trainer_log = (tmp_path / "add" / "services" / "trainer.log").read_text()
    created = re.findall(r"job (\w+): created on base .*, resident once for (\d) job", trainer_log)
    # one base for all three: each job found the others' base resident (created together, two may count two)
    assert sorted(job for job, _ in created) == ["add", "late", "sort"], created
    assert max(int(n) for _, n in created) >= 2
    base = json.loads((ROOT / "lorarl/assets/models/qwen3-tiny/build_info.json").read_text())[
        "test_greedy_accuracy_per_task"]
    for name, task in (("add", "add"), ("sort", "sort")):
        rows = metrics(tmp_path / name)
        evals = [r for r in rows if "eval/accuracy" in r]
        steps = [r for r in rows if "rollout/reward_mean" in r]
        print(f"{name}: held-out {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f} in "
              f"{evals[-1]['time_s']:.0f} s of loop")
        assert len(steps) == 40 and sorted(r["train/version"] for r in steps)[-1] == 40
        # a healthy run: +50.0 and +48.7 points, the same in every run here (bench/readme_figures.py)
        assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= 0.40, (name, evals)
        # evaluated on its own task only: the base's greedy accuracy on that task (0.36 over both)
        assert evals[0]["eval/accuracy"] == pytest.approx(base[task], abs=0.02), (name, base)
