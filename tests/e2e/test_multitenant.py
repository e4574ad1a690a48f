"""examples/multitenant end to end, on one stack: `lorarl run sort.yaml tools.yaml` — the demo's digit sorting
(single-turn) and the calculator agent (multi-turn, through the rollout's OpenAI endpoint), with their own
tasks, LoRA ranks, losses and rewards, on one base that knows both. The trainer holds the base once for all of
them (its log says so when the jobs are created), the one rollout serves every job's adapters, and each job's
held-out success rises: sorting by at least 42 points, the agent by 30 (FLOOR; healthy runs below). The agent
is examples/calc_agent.py, the code examples/agent-tools.yaml trains on its own base (that file is dry-run by
tests/unit/test_docs_commands.py; its 40-step learning is in bench/RESULTS.md): its own stack cost the suite
3 minutes, so its checks (tool replies masked, the guard probing every version, no alarm) run here. While they
run, a third job attaches to their stack (`--attach`) and trains on it, and the owner keeps the services up until it
ends; then, the stack still up, a fourth job attaches: examples/distill's student, which distils both domains from
the two jobs' last versions (`sort@v20`, `tools@v12`, read from the stack's weight sync: on-policy distillation from
other jobs' published versions, #47), the agent's chat turns scored by the rollout's endpoint. One stack for all
checks: starting a second one would cost the suite a minute (#29's budget). The jobs
run the first 20 (sorting) and 12 (the agent) of their 40 steps here: sorting was past +50 at step 10 in every
run, the agent at +40 and +45 (their 40 steps cost the suite two more minutes)."""

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
STUDENT = ROOT / "examples" / "distill" / "student.yaml"
SORT_STEPS, AGENT_STEPS, PUPIL_STEPS = 20, 12, 3
#: Each job's held-out gain, within ~10 points of what healthy runs reach at these steps (issue "the first hour"):
#: sorting +52 at step 10 in both runs measured (2026-12-05; +58.0 at 40 steps), the agent +40 and +45 at step 10
#: (+53.0 at 40). The jobs are async and share one engine: not reproducible run to run.
FLOOR = {"sort": 0.42, "tools": 0.30}


def job_file(tmp: Path, name: str, job_id: str | None = None, steps: int | None = None) -> Path:
    """The example's job file with its output in ``tmp`` (the model and data by absolute path; the workflow
    from the example's folder, on the runs' PYTHONPATH)."""
    cfg = yaml.safe_load((EXAMPLE / f"{name}.yaml").read_text())
    cfg["job_id"] = job_id or cfg["job_id"]
    cfg["output"]["dir"] = str(tmp / cfg["job_id"])
    cfg["model"]["path"] = str(ROOT / cfg["model"]["path"])
    for key in ("train_path", "test_path"):
        if key in cfg["data"]:
            cfg["data"][key] = str((EXAMPLE / cfg["data"][key]).resolve())
    if steps:
        cfg["loop"]["steps"] = steps
    path = tmp / f"{cfg['job_id']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def pupil_file(tmp: Path) -> Path:
    """examples/distill/student.yaml (one student of both domains, its workflow the sort job's single turn or the
    calculator agent by row) for PUPIL_STEPS, its teachers this stack's two jobs' last versions instead of their
    exports: sort@v20 and tools@v12, another job's published version each (#47)."""
    cfg = yaml.safe_load(STUDENT.read_text())
    cfg["job_id"], cfg["output"] = "pupil", {"dir": str(tmp / "pupil")}
    cfg["model"]["path"] = str(ROOT / cfg["model"]["path"])
    for key in ("train_path", "test_path"):
        cfg["data"][key] = str((STUDENT.parent / cfg["data"][key]).resolve())
    cfg["distill"]["teachers"] = [{"name": name, "job": f"{name}@v{steps}", "domain": name}
                                  for name, steps in (("sort", SORT_STEPS), ("tools", AGENT_STEPS))]
    cfg["loop"].update(steps=PUPIL_STEPS, eval_every=0, checkpoint_every=0)
    path = tmp / "pupil.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def delete_job(services: Path, job_id: str) -> None:
    """Deletes ``job_id`` from the stack's trainer (its address and token as the owner wrote them)."""
    from lorarl.common.channel import sync_channel
    from lorarl.v1 import trainer_pb2, trainer_pb2_grpc

    address = json.loads((services / "stack.json").read_text())["trainer"]
    with sync_channel(address, token=(services / "token").read_text().strip()) as channel:
        trainer_pb2_grpc.TrainerServiceStub(channel).DeleteJob(trainer_pb2.DeleteJobRequest(job_id=job_id), timeout=60)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_jobs_on_one_base_both_learn_and_a_third_attaches(tmp_path: Path) -> None:
    files = [job_file(tmp_path, "sort", steps=SORT_STEPS), job_file(tmp_path, "tools", steps=AGENT_STEPS)]
    late = job_file(tmp_path, "sort", job_id="late")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")]))}
    quiet = ["output.tensorboard=false", "output.progress=false"]
    # adapter slots for a third staleness window (3 stale versions and the current one): room for the job
    # that attaches (and for the pupil's window and teacher after it)
    out_file, err_file = tmp_path / "owner.out", tmp_path / "owner.err"
    with out_file.open("w") as out_sink, err_file.open("w") as err_sink:
        owner = subprocess.Popen([*lorarl_command(), "run", *map(str, files), "rollout.max_loras=16", *quiet,
                                  "--fresh"], cwd=ROOT, stdout=out_sink, stderr=err_sink, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while not ((tmp_path / "sort" / "services" / "stack.json").exists()
                   and (tmp_path / "sort" / "config.json").exists()):
            assert owner.poll() is None and time.monotonic() < deadline, err_file.read_text()[-3000:]
            time.sleep(0.5)
        # the lease the attached run takes when it starts, taken now for it: the owner's jobs cannot end the
        # stack while the attached process is still importing (it rewrites the lease, and drops it at exit)
        leases = tmp_path / "sort" / "services" / "attached"
        leases.mkdir(exist_ok=True)
        (leases / "late").write_text(str(os.getpid()))
        # and one this test holds itself: whichever ends first, the owner's jobs or the attached one, the
        # owner must keep its services up (and say so) until this lease is dropped too
        (leases / "holder").write_text(str(os.getpid()))
        attached = subprocess.run([*lorarl_command(), "run", str(late), "--attach", str(tmp_path / "sort"),
                                   "loop.steps=12", "loop.eval_every=0", "recovery.wait_s=30", *quiet, "--fresh"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=900)
        # the owner's own jobs end, and it says whom it waits for
        while "the services stay up for the attached" not in err_file.read_text():
            assert owner.poll() is None and time.monotonic() < deadline + 900, err_file.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(3)
        assert owner.poll() is None, "the owner stopped its services while a lease was held"
        # while the stack stays up, a fourth job attaches: examples/distill's student, distilling both domains from
        # the two jobs' last versions (sort@v20, tools@v12), which it reads from this stack's weight sync; `late` and
        # the ended `tools` are deleted from the trainer first (their versions stay in weight sync): the trainer
        # holds 4 jobs, and the pupil brings two teachers' beside its own
        for ended in ("late", "tools"):
            delete_job(tmp_path / "sort" / "services", ended)
        pupil_env = {**env, "PYTHONPATH": os.pathsep.join([str(STUDENT.parent), env["PYTHONPATH"]])}
        pupil = subprocess.run([*lorarl_command(), "run", str(pupil_file(tmp_path)), "--attach",
                                str(tmp_path / "sort"), "recovery.wait_s=30", *quiet, "--fresh"],
                               cwd=ROOT, capture_output=True, text=True, timeout=600, env=pupil_env)
        (leases / "holder").unlink()
        owner.wait(timeout=300)
        out, err = out_file.read_text(), err_file.read_text()
    finally:
        if owner.poll() is None:
            owner.kill()
    assert owner.returncode == 0, out[-4000:] + err[-3000:]
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr[-3000:] + out[-2000:]
    assert "services up for 2 jobs" in out and "sort exited 0, tools exited 0" in out
    assert re.search(r"^\[sort\] ", out, re.M) and re.search(r"^\[tools\] ", out, re.M)
    assert "attached to the services of" in attached.stdout
    assert pupil.returncode == 0, pupil.stdout[-3000:] + pupil.stderr[-3000:]
    for name, steps, rank in (("sort", SORT_STEPS, 16), ("tools", AGENT_STEPS, 8)):
        assert f"teacher {name} is {name} v{steps} from weight sync (rank {rank})" in pupil.stdout, pupil.stdout[-2000:]
    from lorarl.contract.peft import read_peft_tensors

    for name in ("sort", "tools"):  # each job's last version as it exported it (the stack's first job holds both)
        read = read_peft_tensors(tmp_path / "pupil" / "teachers" / name)
        final = read_peft_tensors(tmp_path / "sort" / "exports" / name / "final-adapter")
        assert read.keys() == final.keys() and all(read[k].equal(final[k]) for k in read), name
    distilled = [r for r in metrics(tmp_path / "pupil") if "rollout/reward_mean" in r]
    assert len(distilled) == PUPIL_STEPS, distilled
    # every row went to its domain's teacher: the agent's chat turns too (scored by the rollout's endpoint)
    assert all(abs(r["distill/sort/prompt_share"] + r["distill/tools/prompt_share"] - 1) < 1e-6 for r in distilled)
    assert all(0 < r["distill/tools/prompt_share"] < 1 for r in distilled), distilled
    assert all(r["rollout/context_tokens"] > 0 for r in distilled)  # tools rows ran the agent: tool replies, masked
    kl = [r[f"distill/{name}/reverse_kl"] for r in distilled for name in ("sort", "tools")]
    assert all(v == v for v in kl), kl  # measured (a sampled estimate: either sign), not NaN
    assert re.search(r"the services stay up for the attached job\(s\) (late, )?holder", err), err[-2000:]
    assert max(r.get("train/version", 0) for r in metrics(tmp_path / "late")) == 12

    trainer_log = (tmp_path / "sort" / "services" / "trainer.log").read_text()
    created = re.findall(r"job (\w+): created on base .*qwen3-tiny-mixed, resident once for (\d) job", trainer_log)
    # one base for all four: each job found the others' base resident (created together, two may count two)
    assert sorted(job for job, _ in created) == ["late", "pupil", "sort", "tools"], created
    assert max(int(n) for _, n in created) >= 2
    base = json.loads((ROOT / "lorarl/assets/models/qwen3-tiny-mixed/build_info.json").read_text())
    # evaluated on its own task only: the base's greedy success there (the agent's: its two-turn episodes)
    start = {"sort": base["test_greedy_accuracy_per_task"]["sort"], "tools": base["test_greedy_tools"]["success"]}
    for name, steps_run in (("sort", SORT_STEPS), ("tools", AGENT_STEPS)):
        rows = metrics(tmp_path / name)
        evals = [r for r in rows if "eval/accuracy" in r]
        steps = [r for r in rows if "rollout/reward_mean" in r]
        print(f"{name}: held-out {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f} in "
              f"{evals[-1]['time_s']:.0f} s of loop")
        assert len(steps) == steps_run and sorted(r["train/version"] for r in steps)[-1] == steps_run
        assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= FLOOR[name], (name, evals)
        assert evals[0]["eval/accuracy"] == pytest.approx(start[name], abs=0.02), (name, start)
    tools = [r for r in metrics(tmp_path / "tools") if "rollout/reward_mean" in r]
    assert all(r["rollout/context_tokens"] > 0 for r in tools)  # the tool's replies, masked
    assert all(r["train/tokens"] == r["rollout/tokens"] for r in tools)
    # every step of a healthy agent job (the checks tests/e2e/test_agent_tools.py made on a stack of its own until
    # issue "the first hour" folded it in here): the served-policy guard probed every version it could (the last
    # one's activation outlives the last step's record) and never fired, nor did the mismatch alarm
    assert sorted(r["policy/guard_version"] for r in tools[1:])[-1] >= AGENT_STEPS - 1
    assert all(r["policy/guard_alarm"] == 0 and r["policy/guard_abs_diff"] < 1e-3 for r in tools[1:])
    assert all(r["policy/mismatch_alarm"] == 0 for r in tools)
