"""Canary for the vLLM internals services/rollout/vllm_worker_ext.py relies on.

Fails loudly, naming the symbol, when a vLLM upgrade moves or changes them; the integration tests
then check behaviour on a live engine (probe, adapter parity, MoE reload parity). Two checks guard
workarounds for vLLM CPU reload bugs: if vLLM starts re-prepacking MoE experts itself on a weight
update, our extra prepack would pack twice, so this test must fail and the workaround must go.
"""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.vllm


def source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


def test_lora_manager_internals_used_by_the_memory_loader() -> None:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    assert issubclass(LRUCacheWorkerLoRAManager, WorkerLoRAManager)
    assert list(inspect.signature(WorkerLoRAManager._load_adapter).parameters) == ["self", "lora_request"]
    init = source(WorkerLoRAManager.__init__)
    for attr in ("self._lora_model_cls", "self.vocab_size", "self.lora_config", "self.max_position_embeddings",
                 "self._adapter_manager"):
        assert attr in init, f"WorkerLoRAManager no longer sets {attr}"
    manager_init = source(LoRAModelManager.__init__)
    for attr in ("self.supported_lora_modules", "self.packed_modules_mapping", "self.model"):
        assert attr in manager_init, f"LoRAModelManager no longer sets {attr}"
    params = inspect.signature(LoRAModel.from_lora_tensors).parameters
    for name in ("lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size", "weights_mapper",
                 "skip_prefixes"):
        assert name in params, f"LoRAModel.from_lora_tensors lost its {name!r} parameter"
    helper = PEFTHelper.from_dict({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                                   "vllm_max_position_embeddings": 128})
    assert helper.vllm_lora_scaling_factor == 2.0 and callable(helper.validate_legal)
    assert parse_fine_tuned_lora_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")[0] \
        == "model.layers.0.self_attn.q_proj"
    assert LoRARequest("x-v1", 1, "lorarl-mem://x-v1").lora_path.startswith("lorarl-mem://")


def test_worker_extension_and_reload_entry_points() -> None:
    from vllm.config import ParallelConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    assert "worker_extension_cls" in ParallelConfig.__dataclass_fields__
    assert callable(Worker.reload_weights)
    params = inspect.signature(GPUModelRunner.reload_weights).parameters
    assert {"weights_iterator", "is_checkpoint_format"} <= set(params)
    assert "self.lora_manager" in source(LoRAModelRunnerMixin.load_lora_model)


def test_cpu_reload_bugs_worked_around_are_still_there() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    setup = source(UnquantizedFusedMoEMethod._setup_kernel)
    assert "if not is_weight_update:" in setup and "fused_experts.process_weights_after_loading" in setup, (
        "vLLM changed how MoE experts are (re)processed on a weight update: re-check _repack_cpu_moe_experts")
    prepack = source(CPUUnquantizedExperts.process_weights_after_loading)
    assert "cpu_prepack_moe_weight" in prepack and callable(CPUUnquantizedExperts._padded_intermediate_size)
    assert "dispatch_cpu_unquantized_gemm" in source(UnquantizedEmbeddingMethod.process_weights_after_loading)


def test_cpu_generator_rewind_bug_worked_around_is_still_there() -> None:
    """_skip_cpu_generator_rewind hides generators from exactly this rewind; if vLLM stops rewinding
    (or rewinds elsewhere), the workaround must be revisited."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = source(GPUModelRunner._bookkeeping_sync)
    assert "self.discard_request_mask.np[:num_reqs]" in bookkeeping
    assert "gen = self.input_batch.generators.get(int(i))" in bookkeeping
    assert "gen.set_offset(gen.get_offset() - 4)" in bookkeeping


@pytest.mark.parametrize("indices", [[0, 0, 0, 0, 0], [1, 0, 1, -1, 2], [-1, -1, -1, -1, -1]])
def test_grouped_cpu_lora_ops_equal_vllms(indices: list[int]) -> None:
    """The grouped CPU LoRA ops compute what vLLM's per-token torch ops compute, every entry point."""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    from services.rollout.vllm_worker_ext import _bgmv_expand, _bgmv_expand_slice, _bgmv_shrink

    g = torch.Generator().manual_seed(0)
    idx = torch.tensor(indices)
    x = torch.randn(5, 32, generator=g)
    a = torch.randn(3, 1, 8, 32, generator=g)  # [slots, 1, rank, in]
    b = torch.randn(3, 1, 24, 8, generator=g)  # [slots, 1, out, rank]
    h = torch.randn(5, 8, generator=g)
    cases = ((_bgmv_shrink, lora_ops.bgmv_shrink, x, a, 8, 0.5), (_bgmv_expand, lora_ops.bgmv_expand, h, b, 24, True))
    for ours, theirs, inputs, weights, width, last in cases:
        expected = torch.randn(5, width, generator=g)  # expand adds into what is there
        got = expected.clone()
        theirs(inputs, weights, expected, idx, last)
        ours(inputs, weights, got, idx, last)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    out_theirs, out_ours = torch.zeros(5, 40), torch.zeros(5, 40)
    lora_ops.bgmv_expand_slice(h, b, out_theirs, idx, 8, 24, True)
    _bgmv_expand_slice(h, b, out_ours, idx, 8, 24, True)
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-5)
    assert out_ours[:, :8].abs().sum() == 0 and out_ours[:, 32:].abs().sum() == 0
