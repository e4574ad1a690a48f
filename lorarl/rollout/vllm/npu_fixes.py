"""What a weight reload on vllm-ascend must undo and redo (platform code, like cpu_fixes.py).

vllm-ascend's AscendUnquantizedFusedMoEMethod.process_weights_after_loading stores MoE expert
weights transposed (w13_weight, w2_weight: dims 1 and 2 swapped) as fresh `nn.Parameter`s, which
drops their `weight_loader`, already at engine start. So `install` runs when the worker starts (the
parameters re-created then get their loader back, later ones keep it), and a reload puts the experts
back into vLLM's loader layout first, each parameter once (found by the module that owns it, so a
LoRA wrapper's `.base_layer.` view is not transposed again), and loads a decoder layer per call. This is what AReaL's
ascend-v1.0.5 worker extension does (areal/engine/vllm_ext/vllm_worker_extension.py:
undo_moe_postprocess_for_reload and its patch of the MoE method). UNTESTED on hardware: CPU tests
check the layout arithmetic on stand-in modules; bench/npu_check.py checks it on a 910B.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")

EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def expert_layers(model: Any) -> list[Any]:
    """The modules that own fused expert weights themselves (vLLM's FusedMoE), each once: a LoRA wrapper
    that only forwards to its base layer (`.base_layer.w13_weight`) is not counted a second time."""
    return [m for m in model.modules() if all(name in m._parameters for name in EXPERT_WEIGHTS)]


def undo_moe_expert_layout(model: Any) -> int:
    """Transposes the NPU's expert weights back to vLLM's loader layout, each parameter once; returns how
    many. process_weights_after_loading transposes them again after the reload."""
    count, seen = 0, set()
    for layer in expert_layers(model):
        for name in EXPERT_WEIGHTS:
            param = layer._parameters[name]
            if id(param) in seen:
                continue
            seen.add(id(param))
            param.data = param.data.transpose(1, 2).contiguous()
            count += 1
    return count


def restore_weight_loaders(model: Any) -> int:
    """Gives the expert parameters vllm-ascend re-created at start (without a `weight_loader`) their
    layer's loader again; returns how many needed it. Without it the first reload raises AttributeError."""
    count = 0
    for layer in expert_layers(model):
        loader = getattr(layer, "weight_loader", None)
        for name in EXPERT_WEIGHTS:
            param = layer._parameters[name]
            if loader is not None and getattr(param, "weight_loader", None) is None:
                param.weight_loader = loader
                count += 1
    return count


def layer_batches(weights: Iterable[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive tensors of one decoder layer (``...layers.N.``) together, every other tensor alone: one
    load_weights call per layer, not per tensor (a 30B MoE has ~18,000 tensors in 48 layers)."""
    batch: list[tuple[str, Any]] = []
    key: str | None = None
    for name, tensor in weights:
        match = _LAYER.search(name)
        this = match.group(0) if match else None
        if batch and (this is None or this != key):
            yield batch
            batch = []
        batch.append((name, tensor))
        key = this
    if batch:
        yield batch


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


def install(model: Any) -> int:
    """At worker start, before any reload: vllm-ascend's MoE method keeps the loaders of the parameters
    it re-creates from now on, and those it re-created at start get theirs back; returns how many."""
    from vllm_ascend.ops.fused_moe.fused_moe import AscendUnquantizedFusedMoEMethod

    keep_moe_weight_loaders(AscendUnquantizedFusedMoEMethod)
    return restore_weight_loaders(model)
