"""What Ascend NPUs refuse, in one place: the job file's checks (`--dry-run`) and the rollout's engine
start both ask here, so a job is told before anything starts on the NPUs.

Each rule names its source in vllm-ascend v0.23.0 (the Ascend image's base), checked by reading it
(tests/unit/rollout/test_vllm_surface.py reads that release): attention kernels take 128-token KV
blocks (AscendAttentionBackend.get_supported_kernel_block_sizes() -> [128]; with none set,
vllm_ascend.utils.refresh_block_size picks 128); attention runs in fp16/bf16 only (vLLM's
AttentionBackend.supported_dtypes, which the Ascend backend keeps); RL weight updates need
VLLM_ASCEND_ENABLE_NZ=0 (NPUWorker._check_nz_disabled); megatron-core needs MindSpeed on NPUs,
which lorarl does not ship. LoRA of rank >= 128 runs on vLLM's pure-torch ops, not the NPU kernels
(PunicaWrapperNPU.__init__); MoE LoRA refuses expert parallelism, dynamic EPLB, the fused MC2 path and
shared experts (lora/fused_moe.py, _assert_ascend_moe_lora_supported); and a merged reload there goes
per tensor (NPUWorker has no reload_weights), re-creating the expert parameters captured ACL graphs
point at (AscendUnquantizedFusedMoEMethod.process_weights_after_loading).
"""

from __future__ import annotations

from collections.abc import Mapping

ATTENTION_BLOCK = 128
DTYPES = ("bfloat16", "float16")
NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"
NZ_FOR_RL = "0"


#: vllm-ascend serves LoRA from this rank up with vLLM's torch ops instead of its NPU kernels.
LORA_KERNEL_RANK_LIMIT = 128
MC2_ENV = "VLLM_ASCEND_ENABLE_FUSED_MC2"
#: HF config keys that give a MoE model shared experts (Qwen2-MoE, DeepSeek); Qwen3-MoE has none.
SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def is_npu(device: str) -> bool:
    return device.split(":", 1)[0] == "npu"


def has_shared_experts(hf_config: Mapping[str, object]) -> bool:
    text = hf_config.get("text_config")
    config = text if isinstance(text, Mapping) else hf_config
    return any(isinstance(config.get(k), int) and config.get(k) for k in SHARED_EXPERT_KEYS)  # type: ignore[arg-type]


def moe_lora_blockers(hf_config: Mapping[str, object], environ: Mapping[str, str]) -> list[str]:
    """Why vllm-ascend cannot serve LoRA on this MoE model ([] when it can). lorarl never turns on vLLM's
    expert parallelism or dynamic EPLB, the other two things Ascend's MoE LoRA refuses."""
    reasons = []
    if has_shared_experts(hf_config):
        reasons.append("the model has shared experts, which Ascend's MoE LoRA does not wrap")
    if environ.get(MC2_ENV, "0") not in ("", "0"):
        reasons.append(f"{MC2_ENV}={environ[MC2_ENV]} is set, and the fused MC2 path cannot carry LoRA")
    return reasons


def lora_rank_problems(max_lora_rank: int, *, rank_key: str) -> list[str]:
    if max_lora_rank < LORA_KERNEL_RANK_LIMIT:
        return []
    return [f"{rank_key}: {max_lora_rank}; vllm-ascend serves LoRA of rank >= {LORA_KERNEL_RANK_LIMIT} with vLLM's "
            f"pure-torch ops instead of its NPU kernels (PunicaWrapperNPU), many times slower; set {rank_key} "
            "to 64 or less, or sync.mode: merged (merged weights need no LoRA)"]


def merged_reload_problems(enforce_eager: bool | None, *, eager_key: str) -> list[str]:
    """Merged weights on vllm-ascend 0.23 reload per tensor, which re-creates the MoE expert parameters:
    ACL graphs captured at start (enforce_eager false, the NPU default) would keep reading the old ones."""
    if enforce_eager is True:
        return []
    return [f"{eager_key}: {'null (graphs on NPUs)' if enforce_eager is None else 'false'} captures ACL graphs, "
            "but merged weights reload per tensor on vllm-ascend 0.23 (its NPUWorker has no reload_weights) and "
            "the reload re-creates parameters the graphs point at; with sync.mode merged set "
            f"{eager_key}: true, or serve adapters (sync.mode: adapter)"]


def rollout_problems(block_size: int | None, dtype: str, *, block_key: str, dtype_key: str) -> list[str]:
    """What vLLM on an NPU would refuse in these engine settings (block_size None/0: the platform's own)."""
    problems = []
    if dtype not in (*DTYPES, "auto"):
        problems.append(f"{dtype_key}: {dtype} is not served on Ascend (its attention backend takes "
                        f"{' or '.join(DTYPES)}); set {dtype_key}: bfloat16")
    if block_size and block_size % ATTENTION_BLOCK:
        problems.append(f"{block_key}: {block_size} tokens; Ascend's attention kernel takes {ATTENTION_BLOCK}-token "
                        f"blocks (vLLM would fail with 'No common block size'); set {block_key}: "
                        f"{ATTENTION_BLOCK}, or 0 for the platform's own")
    return problems


def trainer_problems(engine: str, *, engine_key: str) -> list[str]:
    if engine == "megatron":
        return [f"{engine_key}: megatron-core needs MindSpeed (Ascend's adaptation of it) on NPUs, which lorarl "
                f"does not ship; set {engine_key}: torch"]
    return []


def environment_problems(environ: Mapping[str, str]) -> list[str]:
    value = environ.get(NZ_ENV)
    if value is not None and value != NZ_FOR_RL:
        return [f"{NZ_ENV}={value} is set: vllm-ascend refuses RL weight updates into FRACTAL_NZ-cast weights; "
                f"unset it (the rollout sets {NZ_ENV}={NZ_FOR_RL}) or set {NZ_FOR_RL}"]
    return []
