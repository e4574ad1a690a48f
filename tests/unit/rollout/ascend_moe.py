"""Stand-ins, on CPU, for the vllm-ascend 0.23.0 and vLLM MoE code route capture rests on (NOT the real classes).

vllm-ascend needs torch_npu and CANN, so tests/unit/rollout/test_npu_routes.py drives lorarl's taps with these
instead, and checks the real 0.23.0 source for every name and call site copied here (surface.py). Each keeps
only what npu_routes.py and route_recorder.py touch, shaped as the original:

    select_experts                      vllm_ascend/ops/fused_moe/experts_selector.py:30, bound in fused_moe.py's
                                        globals: (topk_weights, topk_ids [tokens, k]) of the router logits
    AscendUnquantizedFusedMoEMethod     vllm_ascend/ops/fused_moe/fused_moe.py:97; `apply(layer, x, ...)` calls
                                        `select_experts` by that global name (fused_moe.py:177)
    AscendFusedMoE                      vllm_ascend/ops/fused_moe/fused_moe_0_23_0.py:142 (a vLLM 0.23 FusedMoE):
                                        `layer_name`, `layer_id`, a `router` nobody calls, `quant_method`, and
                                        `forward_impl` calling `self.quant_method.apply(layer=self, ...)` (:497);
                                        `overlap_gate` selects once more before, as :456 does
    VllmFusedMoE                        vLLM's own MoE layer (0.32's MoERunner): its router selects and calls
                                        the capture hook (BaseRouter.select_experts)
    Router                              vLLM's BaseRouter: set_capture_fn, select_experts

Load a fresh copy per test (`load`): the Ascend tap patches the method class and this module's globals.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_COPIES = itertools.count()


def load() -> ModuleType:
    """A fresh copy of this module (its own classes and globals, as if vllm-ascend were imported anew)."""
    spec = importlib.util.spec_from_file_location(f"ascend_moe_copy_{next(_COPIES)}", Path(__file__))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def select_experts(hidden_states: torch.Tensor, router_logits: torch.Tensor, top_k: int, use_grouped_topk: bool,
                   renormalize: bool, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k, int32 ids as npu_moe_gating_top_k returns them."""
    weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


class AscendUnquantizedFusedMoEMethod:
    def apply(self, layer: Any, x: torch.Tensor, use_grouped_topk: bool, top_k: int, router_logits: torch.Tensor,
              renormalize: bool, enable_force_load_balance: bool = False, **kwargs: Any) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(hidden_states=x, router_logits=router_logits, top_k=top_k,
                                                use_grouped_topk=use_grouped_topk, renormalize=renormalize)
        if enable_force_load_balance:  # profile runs: random experts, after the capture point
            topk_ids = torch.argsort(torch.rand(topk_ids.size(0), router_logits.shape[-1]), dim=1)[:, :top_k]
        experts = layer.expert_scale[topk_ids.long()]  # [tokens, k]: a stand-in for the grouped matmuls
        return x * (topk_weights * experts).sum(dim=-1, keepdim=True)


class OtherMoEMethod:
    """A quantized method's stand-in (vllm_ascend/quantization/methods/*): selects in its own module."""

    def apply(self, layer: Any, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return x


class Router:
    """vLLM's BaseRouter: the capture hook, called with the logical ids when this router selects."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.capture_fn: Callable[[torch.Tensor], None] | None = None

    def set_capture_fn(self, capture_fn: Callable[[torch.Tensor], None] | None) -> None:
        self.capture_fn = capture_fn

    def select_experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
        weights, ids = select_experts(hidden_states, router_logits, self.top_k, False, True)
        if self.capture_fn is not None:
            self.capture_fn(ids)
        return weights, ids


class _MoELayer(torch.nn.Module):
    def __init__(self, layer_name: str, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.layer_name, self.top_k = layer_name, top_k
        self.router = Router(top_k)
        self.register_buffer("expert_scale", torch.linspace(0.5, 1.5, num_experts))

    @property
    def layer_id(self) -> int:  # vLLM's FusedMoE.layer_id: extract_layer_index(layer_name)
        [index] = [int(part) for part in self.layer_name.split(".") if part.isdigit()]
        return index


class AscendFusedMoE(_MoELayer):
    def __init__(self, layer_name: str, num_experts: int, top_k: int) -> None:
        super().__init__(layer_name, num_experts, top_k)
        self.quant_method: Any = AscendUnquantizedFusedMoEMethod()
        self.overlap_gate = False  # multistream_overlap_gate
        self.tp_shard: tuple[int, int] | None = None  # (rank, size): prepare() slices tokens (MC2/all2all EP)

    def forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.overlap_gate:
            select_experts(hidden_states, router_logits, self.top_k, False, True)
        tokens = hidden_states.shape[0]
        if self.tp_shard is not None:  # PrepareAndFinalizeWithAll2All.prepare: this rank's tensor_split slice
            rank, size = self.tp_shard
            hidden_states = torch.tensor_split(hidden_states, size)[rank]
            router_logits = torch.tensor_split(router_logits, size)[rank]
        out = self.quant_method.apply(layer=self, x=hidden_states, router_logits=router_logits, top_k=self.top_k,
                                      renormalize=True, use_grouped_topk=False)
        return torch.nn.functional.pad(out, (0, 0, 0, tokens - out.shape[0]))  # finalize's all-gather, elided


class VllmFusedMoE(_MoELayer):
    def forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router.select_experts(hidden_states, router_logits)
        return hidden_states * (weights * self.expert_scale[ids.long()]).sum(dim=-1, keepdim=True)


class LoRAWrapper(torch.nn.Module):
    """vLLM's FusedMoEWithLoRA: holds the layer as `base_layer`, no router or layer_id of its own."""

    def __init__(self, base_layer: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer

    def forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.base_layer.forward_impl(hidden_states, router_logits)


class MoEModel(torch.nn.Module):
    """Decoder stand-in: layer i's router logits are a fixed table row per token id, so the experts each token
    gets are known up front (`expected`)."""

    def __init__(self, layer_cls: type[_MoELayer], moe_layer_ids: list[int], num_experts: int = 8, top_k: int = 2,
                 vocab: int = 32, lora: bool = False) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList()
        for layer_id in moe_layer_ids:
            layer = layer_cls(f"model.layers.{layer_id}.mlp.experts", num_experts, top_k)
            self.layers.append(LoRAWrapper(layer) if lora else layer)
        self.register_buffer("logits", torch.randn(len(moe_layer_ids), vocab, num_experts, generator=generator))
        self.embed = torch.nn.Embedding(vocab, 4)

    def moe(self, index: int) -> Any:
        layer = self.layers[index]
        return layer.base_layer if isinstance(layer, LoRAWrapper) else layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for index, layer in enumerate(self.layers):
            hidden = hidden + layer.forward_impl(hidden, self.logits[index][input_ids])
        return hidden

    def expected(self, token_ids: list[int]) -> torch.Tensor:
        """[tokens, layers, k] experts the stand-in's selection picks for these token ids."""
        ids = torch.tensor(token_ids)
        return torch.stack([select_experts(self.embed(ids), self.logits[i][ids], self.moe(i).top_k, False, True)[1]
                            for i in range(len(self.layers))], dim=1).to(torch.int16)
