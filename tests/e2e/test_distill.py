"""On-policy distillation end to end (#47): `lorarl run examples/distill/two-tasks/student.yaml` with its two teachers
(the shipped RL experts on the demo's sort and add tasks, tests/e2e/distill_experts), each prompt scored by its
task's teacher. The sort expert is an adapter beside the student in its own rollout engine; the add expert is served
as a full model (the base with its adapter merged in, as a teacher that is not an adapter of the job's base would
be) by an engine of its own that the launcher starts beside the student's. The fresh student gains on each domain
held out, the reverse KL to each teacher falls, and the per-teacher metrics are in metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from lorarl.client.launch.local import lorarl_command

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
EXPERTS = Path(__file__).resolve().parent / "distill_experts"
#: Held-out points each domain gains in the run's 12 steps (the example's 64 prompts x 1 sample a step). Measured
#: healthy (2026-12-07, this 2-core CPU, on top of f4792a6; two runs passed, the second printed): sort 0.32 -> 0.71
#: (+39.3), add 0.40 -> 0.71 (+30.7); the experts score 0.88 and 0.90.
GAIN = 0.20
STEPS = 12


def merged_model(adapter: Path, out: Path) -> Path:
    """The shipped tiny base with ``adapter`` merged in, as a full model directory (the trainer's own export)."""
    from lorarl.contract.lora import LoraSpec
    from lorarl.contract.peft import read_peft_config
    from lorarl.contract.training import TrainingSpec
    from lorarl.trainer.engines.torch.engine import TorchEngine

    base = ROOT / "lorarl" / "assets" / "models" / "qwen3-tiny"
    engine = TorchEngine(TrainingSpec(base_model_path=str(base), lora=LoraSpec.from_peft_config(
        read_peft_config(adapter)), init_adapter_path=str(adapter)))
    return engine.export_merged(out)


def test_a_student_distilled_from_an_adapter_and_a_full_model_teacher_learns_both_domains(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "examples" / "distill" / "two-tasks" / "student.yaml").read_text())
    sort, add = raw["distill"]["teachers"]
    sort["adapter"] = str(EXPERTS / "sort")
    del add["adapter"]
    add["model"] = str(merged_model(EXPERTS / "add", tmp_path / "add-model"))
    raw["output"] = {"dir": str(tmp_path / "run"), "tensorboard": False, "progress": False}
    raw["loop"].update(steps=STEPS, eval_every=STEPS, checkpoint_every=0)
    job = tmp_path / "student.yaml"
    job.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([*lorarl_command(), "run", str(job)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "teacher sort serves as student.teacher.sort v1" in done.stdout
    assert f"teacher add serves on its own engine ({tmp_path / 'add-model'})" in done.stdout
    assert (tmp_path / "run" / "services" / "teacher-add.log").is_file()  # its engine: a process of its own
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "train/loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS and len(steps) == STEPS
    for name in ("sort", "add"):
        before, after = evals[0][f"eval/{name}/accuracy"], evals[-1][f"eval/{name}/accuracy"]
        print(f"{name}: held out {before:.3f} -> {after:.3f} in {STEPS} steps")
        assert after - before >= GAIN, (name, before, after)
        kl = [r[f"distill/{name}/reverse_kl"] for r in steps if f"distill/{name}/reverse_kl" in r]
        assert len(kl) >= len(steps) - 2 and sum(kl[-4:]) / 4 < sum(kl[:4]) / 4 / 2, kl  # at least halved
    assert all(r["distill/teacher_seconds"] > 0 and 0 < r["train/distill_reverse_kl"] < 5 for r in steps)
    assert all(abs(r["distill/sort/prompt_share"] + r["distill/add/prompt_share"] - 1) < 1e-9 for r in steps
               if "distill/sort/prompt_share" in r and "distill/add/prompt_share" in r)
