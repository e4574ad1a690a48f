"""A vLLM general plugin (entry point ``vllm.general_plugins``, see pyproject.toml), loaded by vLLM in
every process it starts, the engine core included, before any engine is built.

On CPU it lets ``rollout.block_size`` be 16. vLLM's CPU attention backend declares KV blocks must be
a multiple of 32 tokens, but its C++ kernels run 16-token blocks too (the ``vec16`` ISA, which
``_get_attn_isa`` already picks for such sizes; 8 is refused by the kernel itself). Prefix caching
shares whole blocks only, so with the demo's 14-18-token prompts no two samples of a GRPO group share
anything at 32 or 128 tokens a block; at 16, an 18-token prompt's first block is computed once per
group (in the same engine step: v1 caches a block when it is allocated). Default block sizes are
unchanged; the plugin only widens what may be asked for.
"""

from __future__ import annotations

#: Token alignment of the C++ CPU attention kernels for fp32/bf16 KV caches without AMX tiles.
CPU_KERNEL_BLOCK_ALIGNMENT = 16


def register() -> None:
    """Idempotent (vLLM may call it more than once per process). In every process a rollout starts, a
    watch on its parent (lorarl.common.parent_watch); on CPU, the shared-base loader (placement.colocate) and the
    block-size widening."""
    from vllm.platforms import current_platform

    from lorarl.common.parent_watch import watch_if_marked

    watch_if_marked()

    if not current_platform.is_cpu():
        return
    from lorarl.rollout.vllm.shared_loader import register as register_shared_loader

    register_shared_loader()  # load_format lorarl_shared_base, in an engine-core process too
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    def supported_kernel_block_sizes(kv_cache_spec: object = None) -> list[int | MultipleOf]:
        return [MultipleOf(CPU_KERNEL_BLOCK_ALIGNMENT)]

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(supported_kernel_block_sizes)
