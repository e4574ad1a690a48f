"""Routed-expert capture on vllm-ascend 0.23 (platform code, like npu_fixes.py): a route_recorder `Tap`.

Why its own tap: vLLM 0.23's FusedMoE builds a BaseRouter (`layer.router`, which takes the capture hook
route_recorder.router_tap sets), but vllm-ascend's AscendFusedMoE never calls it. In vllm-ascend 0.23.0 a MoE
layer selects its experts here (file:line in the 0.23.0 sdist):

    ops/fused_moe/fused_moe_0_23_0.py:497  AscendFusedMoE.forward_impl: self.quant_method.apply(layer=self, ...)
    ops/fused_moe/fused_moe.py:177         AscendUnquantizedFusedMoEMethod.apply:
                                           topk_weights, topk_ids = select_experts(...)
    ops/fused_moe/experts_selector.py:30   select_experts: npu_moe_gating_top_k (or a torch top-k)

`select_experts` is a name in fused_moe.py's globals (imported from experts_selector), looked up at each call;
its topk_ids are [tokens, top_k] logical expert ids (the dispatcher maps them through log2phy later, so they are
the trainer's numbering), and the layer is `apply`'s `layer` argument, numbered by vLLM's FusedMoE.layer_id.
vllm-ascend's own capture (`_ascend_routed_experts_capturer`, fused_moe.py:204, only with vLLM's
enable_return_routed_experts) reads the same (layer.layer_id, topk_ids) at the same spot. So the tap wraps
`apply` to note the layer it runs for and rebinds fused_moe's `select_experts` to hand (layer_id, topk_ids) of
a selection made inside `apply` to the recorder. Other selections are not captured: the overlap-gate one in
forward_impl (fused_moe_0_23_0.py:456, whose module imported the original; `apply` selects again), the quantized
methods' (vllm_ascend/quantization/methods/*: their own modules) and the 310P one; a served model with any such
layer is refused at install rather than recorded with holes.

Parallelism (vllm-ascend 0.23.0's MoE communication, ascend_forward_context.select_moe_comm_method): lorarl
never turns on expert parallelism and runs one data-parallel rank per engine, so the MoE uses all-gather
communication, whose prepare() leaves the tokens as they are (or, with flashcomm1, all-gathers the
sequence-parallel shards back): every tensor-parallel rank selects experts for every token, alike, and the
first rank records (worker_ext.lorarl_record_routes). Under expert parallelism (MC2, all-to-all) each TP rank
selects only its 1/TP slice of the padded batch (prepare_finalize.py: tensor_split); the first rank's slice is
the batch's first tokens, so a forward it covers whole is recorded, and one it does not is left unrecorded by the
recorder (fewer rows than tokens, warned once). Graphs: ACL graphs (enforce_eager false, the NPU default) replay
the MoE without running Python, so a replayed forward captures nothing and stays unrecorded; with graphs on,
only forwards run eagerly (batches past the largest captured size) are recorded (route_recorder.graph_warning).

NOT RUN on hardware (no NPU here): tests/unit/rollout/test_npu_routes.py drives the tap on CPU with stand-ins
of these classes and checks the 0.23.0 source for every name and call site it rests on (surface.py).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from lorarl.rollout.vllm.route_recorder import Capture, moe_layers

TAPPED_MODULE = "vllm_ascend.ops.fused_moe.fused_moe"
TAPPED_METHOD = "AscendUnquantizedFusedMoEMethod"
SELECT = "select_experts"


class SelectionTap:
    """Hands each expert selection made inside a tapped `apply` to `capture`, with the layer `apply` runs for.
    One per process: `apply` is not re-entered (one MoE layer at a time), so one slot holds the layer."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.layer: Any = None

    def wrap_apply(self, apply: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(apply)
        def tapped_apply(method: Any, *args: Any, **kwargs: Any) -> Any:
            outer, self.layer = self.layer, kwargs["layer"] if "layer" in kwargs else args[0]
            try:
                return apply(method, *args, **kwargs)
            finally:
                self.layer = outer

        tapped_apply._lorarl_tap = self  # type: ignore[attr-defined]
        return tapped_apply

    def wrap_select(self, select: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
        @functools.wraps(select)
        def tapped_select(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            topk_weights, topk_ids = select(*args, **kwargs)
            if self.layer is not None:
                self.capture(int(self.layer.layer_id), topk_ids)
            return topk_weights, topk_ids

        return tapped_select


def _selects_through(layer: Any, method_cls: type) -> bool:
    """Whether the layer's MoE method runs `method_cls`'s `apply` (a subclass overriding it, or an `apply` set on
    the instance, would select elsewhere)."""
    method = getattr(layer, "quant_method", None)
    return (isinstance(method, method_cls) and getattr(type(method), "apply", None) is method_cls.apply
            and "apply" not in getattr(method, "__dict__", {}))


def tap_selection(module: ModuleType, method_cls: type, model: torch.nn.Module, capture: Capture) -> list[int]:
    """Taps `method_cls.apply` and ``module``'s `select_experts` (the one `apply` calls) for ``capture``; returns
    the MoE layer ids that select through them. Refuses a model with a layer selecting elsewhere (nothing is
    patched then). Idempotent: a second call only points the tap at the new capture."""
    layers = moe_layers(model)
    elsewhere = {layer_id: type(getattr(layer, "quant_method", None)).__name__
                 for layer_id, layer in layers if not _selects_through(layer, method_cls)}
    if elsewhere:
        raise RuntimeError(f"MoE layers {sorted(elsewhere)} select experts in {sorted(set(elsewhere.values()))}, "
                           f"which lorarl does not tap (only {method_cls.__name__}, unquantized experts): their "
                           "routes cannot be recorded on vllm-ascend")
    existing = getattr(method_cls.apply, "_lorarl_tap", None)
    if existing is not None:
        existing.capture = capture
    else:
        tap = SelectionTap(capture)
        setattr(module, SELECT, tap.wrap_select(getattr(module, SELECT)))
        method_cls.apply = tap.wrap_apply(method_cls.apply)
    return [layer_id for layer_id, _ in layers]


def ascend_tap(model: torch.nn.Module, capture: Capture) -> list[int]:
    """route_recorder's Tap on vllm-ascend (NPU workers only: the module imports torch_npu). The names are
    surface.py's CALL_SITES (a test holds them alike)."""
    module = importlib.import_module(TAPPED_MODULE)
    return tap_selection(module, getattr(module, TAPPED_METHOD), model, capture)

