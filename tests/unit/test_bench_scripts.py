"""The benchmark scripts are alive: their command lines parse, and the logic behind their verdicts
(time to target, ratios, PASS/FAIL, the TRL settings derived from a lorarl job) is right.

The runs themselves are minutes long and live in bench/; only the TRL config check needs trl
(`make bench-setup`), which CI does not install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.async_vs_sync import ModeRun, run_order, summarize
from bench.async_vs_sync import table as async_table
from bench.lorarl_job import JobTiming
from bench.trl_vs_lorarl import Curve, time_to_target, trl_spec, verdict
from bench.trl_vs_lorarl import table as trl_table

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["trl_vs_lorarl.py", "async_vs_sync.py", "cpu_pinning.py", "memory_plan.py",
                                    "scaling.py", "gpu_check.py", "trl_at_shape.py", "head_logprobs.py",
                                    "npu_check.py", "receive_in_worker.py", "multitenant.py", "routing_replay.py",
                                    "recovery.py", "soak.py", "multi_lora_pass.py", "service_start.py",
                                    "colocate.py", "one_base_gpu.py", "tenant_flood.py"])
def test_command_line_parses(script: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout


def curve(name: str, points: list[tuple[int, float, float]]) -> Curve:
    return Curve(name, points, startup_s=10.0, total_s=points[-1][1] + 10.0)


def test_time_to_target_is_the_first_saved_step_reaching_it() -> None:
    c = curve("x", [(5, 10.0, 0.5), (10, 20.0, 0.7), (15, 30.0, 0.65), (20, 40.0, 0.8)])
    assert time_to_target(c, 0.7) == (10, 20.0)
    assert time_to_target(c, 0.9) is None


def test_verdict_ratios_and_calls() -> None:
    ours = curve("lorarl", [(5, 5.0, 0.6), (10, 10.0, 0.7)])
    peer = curve("TRL", [(5, 20.0, 0.5), (10, 40.0, 0.72)])
    v = verdict(ours, peer, target=0.7)
    assert v["ratio"] == pytest.approx(10.0 / 40.0) and v["bound"] == "" and v["time_ok"]
    assert v["accuracy_ok"]  # 0.70 vs 0.72 is inside the 5-point tolerance
    assert not verdict(ours, peer, target=0.7, tolerance=0.01)["accuracy_ok"]
    # Only the peer misses: its whole training time bounds its time to target; the ratio is an upper bound.
    v = verdict(ours, peer, target=0.71)
    assert v["ours"] is None and not v["time_ok"]
    v = verdict(peer, ours, target=0.71)
    assert v["bound"] == "<= " and v["ratio"] == pytest.approx(40.0 / 10.0) and not v["time_ok"]
    slow = curve("lorarl", [(10, 30.0, 0.75)])
    assert not verdict(slow, peer, target=0.7)["time_ok"]  # 30 / 40 > 0.5


def test_trl_table_has_the_verdict_rows_and_the_curves() -> None:
    ours = curve("lorarl", [(5, 5.0, 0.6), (10, 10.0, 0.7)])
    peer = curve("TRL", [(5, 20.0, 0.5), (10, 40.0, 0.72)])
    text = "\n".join(trl_table(ours, peer, base=0.36, target=0.66))
    assert "| 0.25x | <= 0.5x | PASS |" in text
    assert "| final held-out accuracy (10 steps) | 0.700 | 0.720 | -2.0 points |" in text
    assert "| 10 | 10.0 | 0.700 | 40.0 | 0.720 |" in text


def test_trl_spec_carries_the_job_and_its_prompt_stream() -> None:
    from lorarl.client.job.config import load_job_config
    from lorarl.client.job.datasets import TrainStream, load_examples

    cfg = load_job_config(str(ROOT / "examples" / "demo.yaml"), ["loop.steps=3", "loop.prompts_per_step=4"])
    spec = trl_spec(cfg, threads=2, export_every=1)
    expected = TrainStream(load_examples("tasks", "train"), cfg.data.seed).take(12)
    assert spec["examples"] == [[e.prompt, e.answer] for e in expected]
    assert (spec["group_size"], spec["max_tokens"], spec["rank"], spec["alpha"]) == (8, 8, 8, 16.0)
    assert spec["learning_rate"] == pytest.approx(0.002) and spec["loss_type"] == "grpo" and spec["kl_coef"] == 0


def test_trl_config_matches_the_job() -> None:
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from bench.trl_grpo import grpo_config_kwargs
    from lorarl.client.job.config import load_job_config

    cfg = load_job_config(str(ROOT / "examples" / "demo.yaml"), ["loop.steps=3"])
    args = GRPOConfig(**grpo_config_kwargs(trl_spec(cfg, threads=2, export_every=1), "/tmp/unused"))
    assert args.num_generations == 8 and args.per_device_train_batch_size == 128
    assert args.generation_batch_size == 128 and args.steps_per_generation == 1  # one generation per step
    assert args.loss_type == "grpo" and args.scale_rewards == "group" and args.beta == 0.0
    assert args.max_completion_length == 8 and args.max_steps == 3 and args.learning_rate == pytest.approx(0.002)
    assert not args.gradient_checkpointing and not args.bf16


def run(mode: str, loop_s: float, accuracy: float) -> ModeRun:
    return ModeRun(mode, startup_s=20.0, loop_s=loop_s, final_accuracy=accuracy, base_accuracy=0.36,
                   profile={"rollout/seconds": 1.0, "train/time_s": 0.5, "sync/seconds": 0.1}, max_lag=1)


def test_async_vs_sync_order_summary_and_table() -> None:
    assert run_order(2) == ["sync", "async", "async", "sync"]
    runs = [run("sync", 60.0, 0.70), run("async", 40.0, 0.68), run("async", 44.0, 0.66), run("sync", 64.0, 0.72)]
    s = summarize(runs)
    assert s["speedup"] == pytest.approx(60.0 / 40.0) and s["mean_speedup"] == pytest.approx(62.0 / 42.0)
    assert s["accuracy"]["async"] == pytest.approx(0.67) and s["equal"] and s["pass"]
    assert not summarize(runs, tolerance=0.02)["pass"]  # 4 points below sync
    text = "\n".join(async_table(runs, steps=40))
    assert "| 1.50x | >= 1.3x | PASS |" in text and text.count("| async | 20.0 s |") == 2


def test_job_timing_takes_evaluations_and_exports_out() -> None:
    timing = JobTiming(mode="sync", loop_s=100.0, eval_s=12.0, export_s=3.0, accuracy_at_step={0: 0.36, 40: 0.8})
    assert timing.train_s == pytest.approx(85.0) and timing.final_accuracy == 0.8


def test_cpu_pinning_bench_tells_the_processes_apart() -> None:
    from bench.cpu_pinning import _process_of

    assert _process_of("VLLM::EngineCore") == "engine"
    assert _process_of("/x/.venv/bin/python /x/.venv/bin/lorarl serve trainer --config t.yaml") == "trainer"
    assert _process_of("/x/.venv/bin/python /x/.venv/bin/lorarl serve rollout --config r.yaml") == "rollout"
    assert _process_of("/x/.venv/bin/python /x/.venv/bin/lorarl serve weightsync --config w.yaml") == "weightsync"
    assert _process_of("/x/.venv/bin/python /x/.venv/bin/lorarl run --fresh examples/demo.yaml") == "loop"
    assert _process_of("/x/python -B -c from multiprocessing.resource_tracker import main;main(24)") is None


@pytest.mark.slow
@pytest.mark.parametrize("script", ["gpu_check.py"])
def test_memory_benchmarks_run_their_quick_rows_on_cpu(script: str) -> None:
    """The trainer-memory rows of bench/gpu_check.py (the GPU session's script), at small sizes on CPU: plan and
    measurement within the benchmark's own tolerance. They are bench/memory_plan.py's rows (its `run_row` and
    `planned`), so memory_plan.py's own quick run is not repeated here (~50 s of the suite, issue "the first
    hour"); its command line is parsed above."""
    args = ["--quick", "--no-write"] + (["--device", "cpu"] if script == "gpu_check.py" else [])
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = list(dict.fromkeys(line for line in done.stdout.splitlines() if line.startswith("| qwen3-0.6b")))
    assert len(rows) == 2
    for row in rows:
        ratio = float(row.split("|")[7 if script == "memory_plan.py" else 6])
        assert 0.8 <= ratio <= 1.2, row
    if script == "gpu_check.py":  # its one-base part: two processes on one copy of the base (memory file on CPU)
        checks = {line.split("|")[1].strip(): line.split("|")[2].strip()
                  for line in done.stdout.splitlines() if line.startswith("| ") and line.count("|") == 3}
        aliased = checks["trainer's base parameters that are views of the shared base"].split(" of ")
        assert aliased[0] == aliased[1] and int(aliased[0]) > 0
        gap = checks["logprobs of the same tokens after the handoff, trainer vs rollout: max abs difference"]
        stale = checks[next(k for k in checks if k.startswith("logprobs of the same tokens before the handoff"))]
        assert float(gap) < 1e-3 < float(stale)  # the rollout applies the trainer's trained adapter, and it matters
        assert "tokens/s" in checks[next(k for k in checks if k.startswith("rollout (HF engine) greedy"))]


@pytest.mark.slow
def test_the_npu_check_runs_on_cpu_and_fails_when_parity_breaks() -> None:
    """bench/npu_check.py (the script for the first Ascend session) end to end on CPU over gloo, two steps, in
    the headline's shape (MoE, merged, TP-2 rollout whose two workers receive each version themselves): the
    rollout's and the trainer's logprobs agree on trained adapters; a tolerance below the measured gap turns the
    row and the exit code to FAILED. One mode: the script's adapter and merged modes run the same code with a
    different sync mode, and `lorarl run` runs those jobs in tests/e2e (a stack of its own here cost ~55 s, #29)."""
    from bench.npu_check import ModeResult

    mode = "moe-merged-tp2"
    command = [sys.executable, str(ROOT / "bench" / "npu_check.py"), "--device", "cpu", "--quick", "--modes", mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=800, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    cells = [c.strip() for c in rows[mode].split("|")[1:-1]]
    assert cells[1] == "2" and int(cells[2]) > 0 and cells[-1] == "ok", rows[mode]
    assert float(cells[4]) < 1e-4 < float(cells[5])  # parity gap tiny, adapter effect not
    measured = ModeResult(mode, version=2, tokens=64, max_diff=float(cells[3]), mean_diff=float(cells[4]),
                          versions_ok=True, effect=float(cells[5]))
    assert measured.ok(1e-3) and not measured.ok(float(cells[3]) / 2)
    assert not ModeResult("adapter", version=2, tokens=64, max_diff=0, mean_diff=0, versions_ok=False,
                          effect=1).ok(1.0)


def test_readme_figures_reads_a_runs_metrics_and_refuses_an_unknown_example(tmp_path: Path) -> None:
    from bench.readme_figures import from_run_dir

    rows = [{"step": 0, "eval/accuracy": 0.36, "time_s": 1.0}, {"step": 1, "rollout/reward_mean": 0.4},
            {"step": 2, "rollout/reward_mean": 0.5}, {"step": 2, "eval/accuracy": 0.82, "time_s": 16.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figure = from_run_dir("demo", "lorarl run examples/demo.yaml", tmp_path, wall_s=40.0)
    assert (figure.before, figure.after, figure.steps, figure.loop_s) == (0.36, 0.82, 2, 16.5)
    assert figure.row() == "| demo | `lorarl run examples/demo.yaml` | 0.360 | 0.820 | +46.0 | 2 | 16.5 | 40 |"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "readme_figures.py"), "--only", "demo,nope",
                           "--no-write"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "nope" in done.stderr


def test_soak_fits_a_slope_within_each_process_life_not_across_restarts() -> None:
    from bench.soak import Sample, lifetime_slopes

    # two lives, each flat after its warm-up, the second starting lower (a restart): flat, not a fall
    lives = [Sample("trainer", 1, step, 500.0 + (50 if step < 10 else 0), 30, 8) for step in range(0, 100, 5)]
    lives += [Sample("trainer", 2, step, 300.0 + (50 if step < 110 else 0), 30, 8) for step in range(100, 200, 5)]
    assert lifetime_slopes(lives, "rss", warmup=10) == pytest.approx(0.0)
    # a leak of 1 MiB every 10 steps in each life: 100 MiB per 1,000 steps
    leaking = [Sample("rollout", 1 + step // 100, step, 400.0 + (step % 100) / 10, 40, 9) for step in range(0, 200, 5)]
    assert lifetime_slopes(leaking, "rss", warmup=10) == pytest.approx(100.0)


def test_soak_holds_each_service_log_to_its_retention(tmp_path: Path) -> None:
    from bench.soak import LOG_SLACK_BYTES, service_logs

    services = tmp_path / "services"
    services.mkdir()
    (services / "trainer.log").write_bytes(b"t" * 1000)
    (services / "weightsync.log").write_bytes(b"w" * 10)
    for copy in (1, 2):
        (services / f"weightsync.log.{copy}").write_bytes(b"w" * 4000)
    (services / "weightsync.log.ready.json").write_text("{}")  # not a rotated copy
    rows, ok = service_logs(tmp_path, cap_bytes=4000, backups=2)
    assert ok and rows == ["| trainer | 1 | 0 | 1 | 1 | yes |", "| weightsync | 0 | 2 | 4 | 8 | yes |"]
    (services / "weightsync.log.3").write_bytes(b"w")  # a copy more than kept
    assert service_logs(tmp_path, cap_bytes=4000, backups=2)[1] is False
    (services / "weightsync.log.3").unlink()
    (services / "trainer.log").write_bytes(b"t" * (4000 + LOG_SLACK_BYTES + 1))  # past the cap and its slack
    rows, ok = service_logs(tmp_path, cap_bytes=4000, backups=2)
    assert not ok and rows[0].endswith("| NO |")


def test_the_batched_multi_job_pass_gives_each_job_its_turns_gradients() -> None:
    """bench/multi_lora_pass.py's batched pass (one base pass over two jobs' rows, each job's adapter on its own
    rows) against the jobs' turns on the shipped tiny model: the same adapter gradients; with the jobs' rows
    swapped, not (the benchmark's check can fail)."""
    import argparse

    import torch

    from bench.multi_lora_pass import adapter_params, measure, round_batched, round_turns

    args = argparse.Namespace(model=str(ROOT / "lorarl/assets/models/qwen3-tiny"), ranks=[16, 8], reps=1,
                              head_chunk=1024)
    result = measure(args, n=2, rows=2, tokens=12)
    assert result["grad_diff"] < 1e-4 and result["turns_s"] > 0 and result["batched_s"] > 0

    from transformers import AutoModelForCausalLM

    from lorarl.contract.lora import LoraSpec
    from lorarl.trainer.rl.lora import attach_lora

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    slots = [attach_lora(model, LoraSpec(rank=r, alpha=2.0 * r), seed=j) for j, r in enumerate((16, 8))]
    for slot in slots:
        for a in slot.adapters.values():
            torch.nn.init.normal_(a.lora_b, std=0.02)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(10, 200, (2, 12), generator=generator) for _ in slots]
    round_turns(model, slots, batches, 1024)
    params = adapter_params(slots)
    turns = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    round_batched(model, slots, batches[::-1], 1024)  # each job's adapter on the other's rows
    assert max((p.grad - g).abs().max().item() for p, g in zip(params, turns, strict=True)) > 1e-3


def test_the_tenant_flood_table_pools_alone_and_divides_by_it() -> None:
    from bench.tenant_flood import Phase, summary

    phases = {"alone": Phase("alone", [1.0, 1.2]), "alone again": Phase("alone again", [1.0, 0.8]),
              "beside held flood": Phase("beside held flood", [1.2, 1.4, 1.3], flood_done=30, flood_s=10.0),
              "beside free flood": Phase("beside free flood", [5.0, 6.0, 7.0], flood_done=90, flood_s=10.0)}
    lines, ratios = summary(phases)
    assert ratios == {"beside held flood": pytest.approx(1.3), "beside free flood": pytest.approx(6.0)}
    assert lines[2] == "| alone | 4 | 1.000 | 1.200 | 1.00 | - |"
    assert lines[3] == "| beside held flood | 3 | 1.300 | 1.400 | 1.30 | 3.0 |"
