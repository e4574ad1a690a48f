"""Canary for the vLLM internals lorarl/rollout/vllm/worker_ext.py relies on.

Fails loudly, naming the symbol, when a vLLM upgrade moves or changes them; the integration tests
then check behaviour on a live engine (probe, adapter parity, MoE reload parity). Two checks guard
workarounds for vLLM CPU reload bugs: if vLLM starts re-prepacking MoE experts itself on a weight
update, our extra prepack would pack twice, so this test must fail and the workaround must go.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

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
    """_rewind_cpu_generators hides generators from exactly this rewind and restores their state around
    the step's sampling; if vLLM stops rewinding (or rewinds or samples elsewhere), it must be revisited."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = source(GPUModelRunner._bookkeeping_sync)
    assert "self.discard_request_mask.np[:num_reqs]" in bookkeeping
    assert "gen = self.input_batch.generators.get(int(i))" in bookkeeping
    assert "gen.set_offset(gen.get_offset() - 4)" in bookkeeping
    assert "self._sample(logits, spec_decode_metadata)" in source(GPUModelRunner.sample_tokens)


def _no_adapter_rows_untouched(theirs: Any, before: Any, no_adapter: Any, untouched: Any = None) -> Any:
    """The reference for our CPU LoRA paths: vLLM's result on rows with an adapter, and ``untouched``
    (default: the input as it was) on rows without one (index -1), the "-1 means no adapter"
    semantics we deliberately keep where vLLM CPU reads the last slot (lorarl/rollout/
    vllm/cpu_lora_ops.py). Rows are independent, so masking vLLM's result is an exact reference."""
    import torch

    keep = no_adapter.reshape(-1, 1)
    return torch.where(keep, before if untouched is None else untouched, theirs)


@pytest.mark.parametrize("indices", [[0, 0, 0, 0, 0], [2, 2, 2, 2, 2], [1, 0, 1, -1, 2], [-1, 2, -1, 2, 2],
                                     [-1, -1, -1, -1, -1]])
def test_grouped_cpu_lora_ops_equal_vllms(indices: list[int]) -> None:
    """The grouped CPU LoRA ops compute what vLLM's per-token torch ops compute on rows with an
    adapter, every entry point; rows with index -1 get no adapter (shrink writes zeros, expand adds
    nothing or writes zeros), where vLLM's ops would read the last slot, which is non-zero here."""
    import torch

    from lorarl.rollout.vllm.cpu_lora_ops import _bgmv_expand, _bgmv_expand_slice, _bgmv_shrink

    ops = _vllm_cpu_lora_ops()
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor(indices)
    x = torch.randn(5, 32, generator=g)
    a = torch.randn(3, 1, 8, 32, generator=g)  # [slots, 1, rank, in]
    b = torch.randn(3, 1, 24, 8, generator=g)  # [slots, 1, out, rank]
    h = torch.randn(5, 8, generator=g)
    cases = ((_bgmv_shrink, ops.bgmv_shrink, x, a, 8, 0.5, True),
             (_bgmv_expand, ops.bgmv_expand, h, b, 24, True, False),
             (_bgmv_expand, ops.bgmv_expand, h, b, 24, False, True))
    for ours, theirs, inputs, weights, width, last, overwrites in cases:
        before = torch.randn(5, width, generator=g)  # expand adds into what is there
        expected, got = before.clone(), before.clone()
        theirs(inputs, weights, expected, idx, last)
        ours(inputs, weights, got, idx, last)
        untouched = torch.zeros_like(before) if overwrites else None
        expected = _no_adapter_rows_untouched(expected, before, idx < 0, untouched)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for add_inputs in (True, False):
        before = torch.randn(5, 40, generator=g)
        out_theirs, out_ours = before.clone(), before.clone()
        ops.bgmv_expand_slice(h, b, out_theirs, idx, 8, 24, add_inputs)
        _bgmv_expand_slice(h, b, out_ours, idx, 8, 24, add_inputs)
        untouched = before.clone()
        if not add_inputs:
            untouched[:, 8:32] = 0
        torch.testing.assert_close(out_ours, _no_adapter_rows_untouched(out_theirs, before, idx < 0, untouched),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(out_ours[:, :8], before[:, :8]) and torch.equal(out_ours[:, 32:], before[:, 32:])


def test_vllm_cpu_applies_the_last_slot_to_rows_without_adapter() -> None:
    """Canary for the vLLM CPU bug our LoRA ops deliberately do not reproduce: its torch ops index
    ``stacked[-1]`` for a token with adapter index -1 (a base-model request), i.e. the last slot,
    and PunicaWrapperCPU only skips them when no token of a prefill has an adapter. When this fails,
    vLLM fixed it: drop the divergence notes in lorarl/rollout/vllm/cpu_lora_ops.py and compare
    against vLLM's ops unmasked again."""
    import torch
    from vllm.lora.punica_wrapper import punica_cpu

    ops = _vllm_cpu_lora_ops()
    g = torch.Generator().manual_seed(4)
    a = torch.randn(2, 1, RANK, HIDDEN, generator=g)
    x = torch.randn(2, HIDDEN, generator=g)
    out = torch.zeros(2, RANK)
    ops.bgmv_shrink(x, a, out, torch.tensor([0, -1]), 1.0)
    torch.testing.assert_close(out[1], x[1] @ a[1, 0].T)  # the last slot's A, not zeros

    widths = (24,)
    stacked_a, stacked_b = _stacked(widths, seed=9)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand",
                     "sgmv_expand_slice"):
            mp.setattr(punica_cpu, name, getattr(ops, name))
        for is_prefill in (True, False):  # a base-model request (id 0) batched with one on adapter 1
            wrapper = _wrappers([0, 1], [1, 2, 3, 4], is_prefill, lean=False)
            x = torch.randn(2, HIDDEN, generator=g)
            y = torch.zeros(2, sum(widths))
            wrapper.add_lora_linear(y, x, stacked_a, stacked_b, 1.0, widths)
            leaked = x[:1] @ stacked_a[0][SLOTS - 1, 0].T @ stacked_b[0][SLOTS - 1, 0].T
            torch.testing.assert_close(y[:1], leaked, rtol=1e-5, atol=1e-5)


def test_cpu_punica_internals_used_by_the_lean_lora_path() -> None:
    """_lean_add_lora_linear replaces PunicaWrapperCPU.add_lora_linear per instance and builds its
    per-step plan in update_metadata from these attributes; it must keep the layers' call shape."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    params = inspect.signature(PunicaWrapperCPU.add_lora_linear).parameters
    assert list(params) == ["self", "y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "output_slices",
                            "buffer", "kwargs"]
    assert params["buffer"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(PunicaWrapperBase.update_metadata).parameters) == [
        "self", "mapping", "lora_index_to_id", "max_loras", "vocab_size", "kwargs"]
    assert "update_metadata" not in PunicaWrapperCPU.__dict__  # the base class's, which we wrap
    assert isinstance(PunicaWrapperBase.__dict__["token_lora_indices"], property)
    init = source(PunicaWrapperBase.__init__)
    for attr in ("self.indices_len", "self.is_prefill", "self.no_lora"):
        assert attr in init, f"PunicaWrapperBase no longer sets {attr}"
    # The per-token indices are written only by update_metadata, so a plan made there holds until the next call.
    assert "self._update_base_metadata(" in source(PunicaWrapperBase.update_metadata)
    assert "self._token_lora_indices[" in source(PunicaWrapperBase._update_base_metadata)
    assert "punica_wrapper.update_metadata(" in source(LoRAModelManager._set_adapter_mapping)
    assert "self.punica_wrapper_mapping[" in source(LoRAModelManager._init_punica_wrapper)
    # The layers call it with a scale, no buffer and update `output` in place (CPU can_update_inplace).
    apply = source(BaseLinearLayerWithLoRA._apply_lora_to_output)
    assert "self.punica_wrapper.add_lora_linear(\n            output, x, self.lora_a_stacked, self.lora_b_stacked, " \
           "1.0, self.output_slices\n        )" in apply
    create = source(BaseLinearLayerWithLoRA.create_lora_weights)
    assert "max_loras,\n                1,\n                lora_a_out_size," in create  # [slots, 1, r, in]
    assert "max_loras,\n                1,\n                lora_b_out_size," in create  # [slots, 1, out, r]


def _vllm_cpu_lora_ops() -> object:
    """A fresh copy of vLLM's torch LoRA ops module, untouched by any patch installed in this process."""
    import importlib.util

    from vllm.lora.ops.torch_ops import lora_ops

    spec = importlib.util.spec_from_file_location("_vllm_lora_ops_reference", lora_ops.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def vllm_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """PunicaWrapperCPU's own methods run on vLLM's original ops for the reference."""
    from vllm.lora.punica_wrapper import punica_cpu

    ops = _vllm_cpu_lora_ops()
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand",
                 "sgmv_expand_slice"):
        monkeypatch.setattr(punica_cpu, name, getattr(ops, name))


@contextlib.contextmanager
def _grouped_ops() -> Iterator[None]:
    """PunicaWrapperCPU on the ops the service installs (ours, reached through vLLM's sgmv wrappers
    too), for calls the lean path hands to vLLM's own method; undone on exit."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from lorarl.rollout.vllm import cpu_lora_ops as ext

    ours = {"bgmv_shrink": ext._bgmv_shrink, "bgmv_expand": ext._bgmv_expand,
            "bgmv_expand_slice": ext._bgmv_expand_slice}
    with pytest.MonkeyPatch.context() as mp:
        for name, op in ours.items():
            mp.setattr(lora_ops, name, op)
            mp.setattr(punica_cpu, name, op)
        for name in ("sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"):
            mp.setattr(punica_cpu, name, getattr(lora_ops, name))
        yield


SLOTS, RANK, HIDDEN = 4, 8, 32


def _stacked(widths: tuple[int, ...], seed: int, dtype: object = None) -> tuple[tuple, tuple]:
    """LoRA layer weights as vLLM stacks them: per slice [slots, 1, r, in] and [slots, 1, out, r]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    a = tuple(torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g).to(dtype) for _ in widths)
    b = tuple(torch.randn(SLOTS, 1, width, RANK, generator=g).to(dtype) for width in widths)
    return a, b


def _wrappers(lora_ids: list[int], slot_ids: list[int | None], is_prefill: bool, lean: bool) -> object:
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from lorarl.rollout.vllm.cpu_lora_ops import _set_lean_lora

    wrapper = PunicaWrapperCPU(64, 16, "cpu")
    if lean:
        _set_lean_lora(wrapper, True)
    mapping = LoRAMapping(tuple(lora_ids), tuple(lora_ids), is_prefill=is_prefill)
    wrapper.update_metadata(mapping, slot_ids, SLOTS + 1, 264)
    return wrapper


#: lora ids per token (0: no adapter, index -1, must stay untouched) over slots holding ids 1..4, or
#: 1, 2 and two free slots (ids 3 and 4 then stand for 1).
PATTERNS = {
    "one adapter": [1] * 13,
    "one adapter, last slot": [4] * 13,
    "two adapters in runs": [1] * 5 + [2] * 8,
    "interleaved with no-adapter rows": [1, 2, 0, 1, 3, 0, 4, 2, 1, 1, 0, 3, 2],
    "adapter and no-adapter rows": [0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0],
    "no adapter at all": [0] * 13,
}


@pytest.mark.parametrize("widths", [(24,), (16, 40), (32, 8, 8)], ids=["1 slice", "2 slices", "3 slices"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("slots", ["full", "free, last zero", "free, last stale"])
def test_lean_add_lora_linear_equals_vllms(vllm_ops: None, widths: tuple[int, ...], pattern: str,
                                           slots: str) -> None:
    """The lean path adds into `y` what vLLM's CPU add_lora_linear adds on rows with an adapter, for
    prefill (V1 always says prefill) and decode metadata, any token count, and leaves -1 rows as they
    were. vLLM reads the last slot for those unless no row of a prefill has an adapter, so with that
    slot holding an adapter ("full") or an evicted adapter's weights ("free, last stale") the old
    vLLM-exact semantics fail here; with it never written ("free, last zero") both agree."""
    import torch

    free = slots != "full"
    slot_ids: list[int | None] = [1, 2, None, None] if free else [1, 2, 3, 4]
    a, b = _stacked(widths, seed=len(widths))
    for t in (*a, *b):
        if free:
            t[2].zero_()
        if slots == "free, last zero":
            t[3].zero_()
    lora_ids = [i if i in slot_ids or i == 0 else 1 for i in PATTERNS[pattern]]
    g = torch.Generator().manual_seed(7)
    for tokens in (1, 6, 13):
        for is_prefill in (True, False):
            for scale in (1.0, 0.5):
                x = torch.randn(tokens, HIDDEN, generator=g)
                expected = torch.randn(tokens, sum(widths), generator=g)
                got = expected.clone()
                reference = _wrappers(lora_ids[:tokens], slot_ids, is_prefill, lean=False)
                lean = _wrappers(lora_ids[:tokens], slot_ids, is_prefill, lean=True)
                assert lean._lorarl_lean_plan is not None
                reference.add_lora_linear(expected, x, a, b, scale, widths)
                expected = _no_adapter_rows_untouched(expected, got, torch.tensor(lora_ids[:tokens]) == 0)
                assert lean.add_lora_linear(got, x, a, b, scale, widths) is None
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
                assert lean._lorarl_lean_builds == 1  # served by the lean path, not vLLM's fallback


def test_lean_add_lora_linear_follows_new_mappings_and_slot_writes(vllm_ops: None) -> None:
    """The plan follows update_metadata, the cached weights follow in-place slot writes (set_lora);
    with a caller's buffer, vLLM's own method on the grouped ops (as installed) gives the same. The
    reference is vLLM's on rows with an adapter, the input on -1 rows (all slots hold adapters)."""
    import torch
    from vllm.lora.layers import LoRAMapping

    widths = (16, 8, 8)
    a, b = _stacked(widths, seed=3)
    slot_ids: list[int | None] = [1, 2, 3, 4]
    lean = _wrappers([1] * 5, slot_ids, True, lean=True)
    g = torch.Generator().manual_seed(1)

    def check(lora_ids: list[int], **kwargs: object) -> None:
        reference = _wrappers(lora_ids, slot_ids, True, lean=False)
        x = torch.randn(len(lora_ids), HIDDEN, generator=g)
        expected = torch.randn(len(lora_ids), sum(widths), generator=g)
        got = expected.clone()
        reference.add_lora_linear(expected, x, a, b, 1.0, widths, **kwargs)
        expected = _no_adapter_rows_untouched(expected, got, torch.tensor(lora_ids) == 0)
        with _grouped_ops():
            lean.add_lora_linear(got, x, a, b, 1.0, widths, **kwargs)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    check([1] * 5)
    for lora_ids in ([2, 2, 1, 1, 1, 0, 0], [3] * 9, [0, 2, 0]):
        lean.update_metadata(LoRAMapping(tuple(lora_ids), tuple(lora_ids), is_prefill=True), slot_ids, SLOTS + 1, 264)
        check(lora_ids)
    builds = lean._lorarl_lean_builds
    b[1][2, 0].copy_(torch.randn(8, RANK, generator=g))  # vLLM's set_lora writes a slot like this
    check([0, 2, 0])
    assert lean._lorarl_lean_builds == builds + 1
    buffer = tuple(torch.zeros(3, RANK) for _ in widths)
    check([0, 2, 0], buffer=buffer)  # vLLM's own method, as the lean path never sees a buffer on CPU
    assert buffer[0].abs().sum() > 0


def test_lean_add_lora_linear_in_bfloat16(vllm_ops: None) -> None:
    """bf16 weights and activations: shrink in fp32, expand rounded as vLLM rounds it (rows with an
    adapter; the -1 row stays as it was)."""
    import torch

    widths = (24, 8)
    a, b = _stacked(widths, seed=5, dtype=torch.bfloat16)
    lora_ids = [1, 1, 2, 0, 2, 1, 1, 1, 3]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(len(lora_ids), HIDDEN, generator=g).bfloat16()
    expected = torch.randn(len(lora_ids), sum(widths), generator=g).bfloat16()
    got = expected.clone()
    _wrappers(lora_ids, [1, 2, 3, 4], True, lean=False).add_lora_linear(expected, x, a, b, 1.0, widths)
    expected = _no_adapter_rows_untouched(expected, got, torch.tensor(lora_ids) == 0)
    _wrappers(lora_ids, [1, 2, 3, 4], True, lean=True).add_lora_linear(got, x, a, b, 1.0, widths)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_lean_lora_switches_off_and_grouped_ops_restore() -> None:
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from lorarl.rollout.vllm import cpu_lora_ops as ext

    wrapper = PunicaWrapperCPU(64, 16, "cpu")
    ext._set_lean_lora(wrapper, True)
    assert wrapper._lorarl_lean_plan is None  # no metadata yet: vLLM's method until update_metadata
    assert wrapper.add_lora_linear.__func__ is ext._lean_add_lora_linear
    ext._set_lean_lora(wrapper, False)
    assert wrapper.add_lora_linear.__func__ is PunicaWrapperCPU.add_lora_linear
    assert not [k for k in vars(wrapper) if k.startswith("_lorarl") or k in ("add_lora_linear", "update_metadata")]

    installed = lora_ops.bgmv_shrink is ext._bgmv_shrink
    try:
        ext._install_grouped_cpu_lora_ops(True)
        assert punica_cpu.bgmv_expand_slice is lora_ops.bgmv_expand_slice is ext._bgmv_expand_slice
        ext._install_grouped_cpu_lora_ops(False)
        assert lora_ops.bgmv_shrink is not ext._bgmv_shrink and punica_cpu.bgmv_expand is not ext._bgmv_expand
        assert lora_ops.bgmv_shrink.__module__ == lora_ops.__name__
    finally:
        ext._install_grouped_cpu_lora_ops(installed)


def test_cpu_attention_runs_16_token_blocks_and_the_plugin_lets_them_be_asked_for() -> None:
    """lorarl/rollout/vllm/plugin.py widens what vLLM's CPU attention backend declares (multiples of
    32) to the C++ kernels' own alignment (16: the vec16 ISA); 8 stays refused by the kernel itself."""
    import torch
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends import cpu_attn

    from lorarl.rollout.vllm.plugin import CPU_KERNEL_BLOCK_ALIGNMENT, register

    assert cpu_attn._get_attn_isa(torch.float32, CPU_KERNEL_BLOCK_ALIGNMENT, 32) == "vec16"
    assert cpu_attn._get_attn_isa(torch.float32, 32, 32) == "vec"
    declared = source(cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes)
    if "MultipleOf(32)" not in declared:  # already replaced in this process (an engine loaded the plugin)
        assert "CPU_KERNEL_BLOCK_ALIGNMENT" in declared
    register()
    register()  # vLLM may load general plugins more than once per process
    assert cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes() == [MultipleOf(16)]
