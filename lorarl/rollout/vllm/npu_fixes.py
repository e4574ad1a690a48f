"""What a weight reload on vllm-ascend must undo and redo (platform code, like cpu_fixes.py).

vllm-ascend's AscendUnquantizedFusedMoEMethod.process_weights_after_loading stores MoE expert
weights transposed (w13_weight, w2_weight: dims 1 and 2 swapped) as fresh `nn.Parameter`s, which
drops their `weight_loader`. A per-tensor reload must therefore put the experts back into vLLM's
loader layout first, and the fresh parameters must keep a loader. This is what AReaL's
ascend-v1.0.5 worker extension does (areal/engine/vllm_ext/vllm_worker_extension.py:
undo_moe_postprocess_for_reload and its patch of the MoE method). UNTESTED on hardware: CPU tests
check the layout arithmetic on stand-in modules; bench/npu_check.py checks it on a 910B.
"""

from __future__ import annotations

from typing import Any

#: Parameter-name fragments of the expert weights vllm-ascend keeps transposed.
TRANSPOSED_EXPERT_WEIGHTS = ("mlp.experts.w13_weight", "mlp.experts.w2_weight")


def undo_moe_expert_layout(model: Any) -> int:
    """Transposes the NPU's expert weights back to vLLM's loader layout; returns how many.
    process_weights_after_loading transposes them again after the reload."""
    count = 0
    for name, param in model.named_parameters():
        if any(fragment in name for fragment in TRANSPOSED_EXPERT_WEIGHTS):
            param.data = param.data.transpose(1, 2).contiguous()
            count += 1
    return count


def keep_moe_weight_loaders(method_cls: Any) -> bool:
    """Patches the MoE method once so the parameters it re-creates keep their layer's weight_loader."""
    if getattr(method_cls, "_lorarl_keeps_loaders", False):
        return False
    original = method_cls.process_weights_after_loading

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        original(self, layer)
        loader = getattr(layer, "weight_loader", None)
        if loader is not None:
            for attr in ("w13_weight", "w2_weight"):
                param = getattr(layer, attr, None)
                if param is not None:
                    param.weight_loader = loader

    method_cls.process_weights_after_loading = process_weights_after_loading
    method_cls._lorarl_keeps_loaders = True
    return True


def install() -> bool:
    """Applies keep_moe_weight_loaders to vllm-ascend's MoE method (on NPU workers, before a reload)."""
    from vllm_ascend.ops.fused_moe.fused_moe import AscendUnquantizedFusedMoEMethod

    return keep_moe_weight_loaders(AscendUnquantizedFusedMoEMethod)
