"""vLLM CPU bugs worked around in the worker (installed by LorarlWorkerExtension): a tied lm_head not
repacked after a weight reload, MoE experts not prepacked again after one, and a Philox-only generator
rewind that kills the engine on a chunked seeded prefill. Each has its canary test, which fails when
vLLM fixes the bug (tests/unit/rollout/test_vllm_internals.py, tests/integration/rollout/)."""

from __future__ import annotations

from typing import Any


def _refresh_tied_lm_head(model: Any) -> bool:
    """Re-derives a tied lm_head's kernel state from the reloaded embedding.

    The checkpoint has no lm_head tensor when embeddings are tied, so the reload skips the layer
    ("ParallelLMHead: Failed to load weights") and, on CPU, its prepacked GEMM weight stays the old
    one although the shared tensor changed. Re-running its post-load processing repacks it.
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None or embed is None or weight.data_ptr() != embed.weight.data_ptr():
        return False
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(lm_head)
    return True


def _repack_cpu_moe_experts(model: Any) -> int:
    """Prepacks reloaded MoE expert weights again for vLLM's CPU grouped-GEMM kernel.

    On a weight update the unquantized MoE method copies the new (unpacked) weights into the
    existing storage and skips the experts' prepack, which only runs on first load, so the CPU
    kernel would read unpacked bytes as packed ones (wrong outputs, no error). Returns layers fixed.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    fixed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
            raise NotImplementedError("in-place reload of padded CPU MoE experts is not supported; restart the engine")
        experts.process_weights_after_loading(module)
        fixed += 1
    return fixed


def _rewind_cpu_generators(runner: Any) -> None:
    """vLLM rewinds a seeded request's generator when it discards the token sampled for a partial
    (chunked) prefill: ``gen.set_offset(gen.get_offset() - 4)``, a Philox (CUDA) notion. A CPU
    generator has no offset, so the first seeded request whose prompt is chunked kills the engine
    ("CPU Generator does not use offset"). Instead, the state of those requests' generators is saved
    just before the step samples and put back after it; the rewind itself is skipped by hiding them
    from that one bookkeeping call. Their tokens are still discarded, and a seeded request samples the
    same tokens however its prompt was chunked, which depends on what else the engine was running."""
    original_sample, original_bookkeeping = runner._sample, runner._bookkeeping_sync

    def discarded_generators() -> dict[int, Any]:
        batch = runner.input_batch
        discarded = runner.discard_request_mask.np[: batch.num_reqs].nonzero()[0]
        return {int(i): batch.generators[int(i)] for i in discarded if int(i) in batch.generators}

    def sample(*args: Any, **kwargs: Any) -> Any:
        runner._lorarl_generator_states = {i: g.get_state() for i, g in discarded_generators().items()}
        return original_sample(*args, **kwargs)

    def bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        hidden = {i: batch.generators.pop(i) for i in discarded_generators()}
        try:
            return original_bookkeeping(*args, **kwargs)
        finally:
            batch.generators.update(hidden)
            states, runner._lorarl_generator_states = runner._lorarl_generator_states, {}
            for i, state in states.items():
                if i in hidden:
                    hidden[i].set_state(state)

    runner._lorarl_generator_states = {}
    runner._sample, runner._bookkeeping_sync = sample, bookkeeping_sync
