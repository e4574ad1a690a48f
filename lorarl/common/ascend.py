"""What Ascend NPUs refuse, in one place: the job file's checks (`--dry-run`) and the rollout's engine
start both ask here, so a job is told before anything starts on the NPUs.

Each rule names its source in vllm-ascend v0.23.0 (the Ascend image's base), checked by reading it
(tests/unit/rollout/test_vllm_surface.py reads that release): attention kernels take 128-token KV
blocks (AscendAttentionBackend.get_supported_kernel_block_sizes() -> [128]; with none set,
vllm_ascend.utils.refresh_block_size picks 128); attention runs in fp16/bf16 only (vLLM's
AttentionBackend.supported_dtypes, which the Ascend backend keeps); RL weight updates need
VLLM_ASCEND_ENABLE_NZ=0 (NPUWorker._check_nz_disabled); megatron-core needs MindSpeed on NPUs,
which lorarl does not ship.
"""

from __future__ import annotations

from collections.abc import Mapping

ATTENTION_BLOCK = 128
DTYPES = ("bfloat16", "float16")
NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"
NZ_FOR_RL = "0"


def is_npu(device: str) -> bool:
    return device.split(":", 1)[0] == "npu"


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
