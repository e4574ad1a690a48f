"""Whether vLLM can run LoRA on a model on a platform, and why not: one rule for the rollout's engine start
(its capabilities, which weight sync's AUTO mode reads) and for `--dry-run`'s plan.

vLLM's CPU backend cannot start a mixture-of-experts model with LoRA; vllm-ascend's MoE LoRA refuses
what lorarl/common/ascend.py's `moe_lora_blockers` lists.
"""

from __future__ import annotations

from collections.abc import Mapping

from lorarl.common import ascend


def lora_blocker(is_moe: bool, device_type: str, hf_config: Mapping[str, object],
                 environ: Mapping[str, str]) -> str:
    """Why vLLM cannot serve LoRA on this model on ``device_type`` ('cpu', 'cuda', 'npu'); '' when it can."""
    if not is_moe:
        return ""
    if device_type == "cpu":
        return "vLLM's CPU backend cannot start a mixture-of-experts model with LoRA"
    if device_type == "npu" and (blockers := ascend.moe_lora_blockers(hf_config, environ)):
        return f"vllm-ascend's MoE LoRA refuses this job: {'; '.join(blockers)}"
    return ""
