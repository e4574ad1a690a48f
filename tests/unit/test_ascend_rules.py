"""What Ascend refuses (lorarl/common/ascend.py): the LoRA rank the NPU kernels take, MoE LoRA's limits,
merged reloads under captured graphs; and how `--dry-run` shows the mode a job gets and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.client.job.config import load_job_config
from lorarl.client.job.plan import model_shape, sync_choice
from lorarl.common import ascend
from lorarl.common.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MOE_NPU = str(ROOT / "examples/npu/qwen3-30b-a3b-merged.yaml")
DENSE_NPU = str(ROOT / "examples/npu/qwen3-0.6b.yaml")


def test_lora_rank_128_and_up_is_refused_on_npus() -> None:
    assert ascend.lora_rank_problems(64, rank_key="k") == []
    [problem] = ascend.lora_rank_problems(128, rank_key="rollout.max_lora_rank")
    assert problem.startswith("rollout.max_lora_rank: 128") and "PunicaWrapperNPU" in problem
    with pytest.raises(ConfigError, match=r"rollout\.max_lora_rank: 256"):
        load_job_config(DENSE_NPU, ["rollout.max_lora_rank=256", "trainer.lora.rank=8"])
    load_job_config(DENSE_NPU, ["rollout.max_lora_rank=256", "sync.mode=merged", "rollout.enforce_eager=true"])


def test_merged_reloads_under_captured_graphs_are_refused_naming_both_settings() -> None:
    assert ascend.merged_reload_problems(True, eager_key="k") == []
    for value in ("false", "null"):
        with pytest.raises(ConfigError, match=r"rollout\.enforce_eager.*sync\.mode merged"):
            load_job_config(MOE_NPU, [f"rollout.enforce_eager={value}"])
    load_job_config(MOE_NPU, [])  # the example sets enforce_eager: true


def test_moe_lora_blockers_follow_vllm_ascends_own_asserts() -> None:
    qwen3_moe = {"num_experts": 128, "moe_intermediate_size": 768}
    assert ascend.moe_lora_blockers(qwen3_moe, {}) == []
    assert ascend.moe_lora_blockers(qwen3_moe, {"VLLM_ASCEND_ENABLE_FUSED_MC2": "0"}) == []
    [mc2] = ascend.moe_lora_blockers(qwen3_moe, {"VLLM_ASCEND_ENABLE_FUSED_MC2": "1"})
    assert "VLLM_ASCEND_ENABLE_FUSED_MC2=1" in mc2
    [shared] = ascend.moe_lora_blockers({"num_experts": 60, "shared_expert_intermediate_size": 5632}, {})
    assert "shared experts" in shared
    assert ascend.has_shared_experts({"text_config": {"n_shared_experts": 1}})
    assert not ascend.has_shared_experts({"n_shared_experts": 0})


def test_the_plan_says_which_mode_and_why() -> None:
    merged = load_job_config(MOE_NPU, [])
    shape = model_shape(merged)
    mode, lora = sync_choice(merged, shape, is_moe=True, environ={})
    assert mode == "merged (sync.mode)" and lora.startswith("off (a merged job's rollouts need no LoRA layers")
    auto = load_job_config(MOE_NPU, ["sync.mode=auto"])
    mode, lora = sync_choice(auto, shape, is_moe=True, environ={"VLLM_ASCEND_ENABLE_FUSED_MC2": "1"})
    assert mode.startswith("merged (auto: vllm-ascend's MoE LoRA refuses this job: VLLM_ASCEND_ENABLE_FUSED_MC2=1")
    assert lora.startswith("off (vllm-ascend's MoE LoRA")
    mode, lora = sync_choice(auto, shape, is_moe=True, environ={})
    assert mode == "adapter (auto: every replica serves LoRA rank 16)" and lora.startswith("on (the default")
    kept = load_job_config(MOE_NPU, ["rollout.enable_lora=true"])
    assert sync_choice(kept, shape, is_moe=True, environ={})[1].endswith("merged weights load into its LoRA-wrapped "
                                                                          "layers")
    cpu_moe = load_job_config(str(ROOT / "examples/moe-merged.yaml"), [])
    assert sync_choice(cpu_moe, model_shape(cpu_moe), is_moe=True, environ={})[0].startswith(
        "merged (auto: vLLM's CPU backend cannot start a mixture-of-experts model with LoRA")
