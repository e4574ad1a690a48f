"""LoRA layers for dense linears and MoE experts, injected into a frozen transformers model.

A LoRA layer keeps the base weight under its original attribute name (``weight`` for a linear,
``gate_up_proj``/``down_proj`` for experts), so every base tensor keeps its Hugging Face name and
the merged model can be streamed in HF names. Adapters live in fp32 whatever the base dtype; the
low-rank update is computed in the activation dtype (fp32 master weights, as in mixed precision).

    y = x W^T + scale * dropout(x) A^T B^T,   scale = alpha / r   (rsLoRA: alpha / sqrt(r))

Several jobs may train adapters on one resident base (lorarl.trainer.engines.torch.shared_base): each LoRA layer
holds the base once and, at any time, one job's adapter (``attach``); a job's adapters across the model are
its ``AdapterSlot``, attached as a whole by ``activate`` before the job computes. Jobs may differ in rank,
alpha, dropout and targets: a layer no attached job adapts runs the base alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lorarl.contract.lora import (  # noqa: F401  (re-exported: the trainer's LoRA names)
    ALL_LINEAR,
    DENSE_TARGETS,
    EXPERT_PROJS,
    LINEAR_ATTENTION_TARGETS,
    LINEAR_TARGETS,
    ExpertMode,
    LoraSpec,
)
from lorarl.contract.merge import lora_delta, merge_lora
from lorarl.contract.peft import tensor_name


class LoraConfig(LoraSpec):
    """A LoRA spec a trainer trains by: `LoraSpec` (lorarl.contract.lora: fields, defaults, scale, PEFT
    config, proto form) whose targets are checked on construction (`LoraSpec.check_trainable`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_trainable()


def _init_pair(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator) -> None:
    """A ~ kaiming-uniform (as nn.Linear), B = 0: the adapter starts as the identity."""
    fan_in = a.shape[-1]
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        a.uniform_(-bound, bound, generator=generator)
        b.zero_()


class _MergedLoRAMatmul(torch.autograd.Function):
    """y = x (W + scale B A)^T + bias as one matmul, where the low-rank path costs a shrink, an expand and
    an add over the whole output (~9% of a CPU train step on the tiny demo model). Backward gives x's
    gradient through the merged weight (recomputed: never stored) and A's and B's through the low-rank
    factors, so no full-size weight gradient is ever formed. The base weight and bias are frozen."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight, a, b)
        ctx.scale = scale
        return F.linear(x, torch.addmm(weight, b, a, alpha=scale), bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, None, None, torch.Tensor, torch.Tensor, None]:
        x, weight, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ torch.addmm(weight, b, a, alpha=ctx.scale)).view(x.shape)
        # Both products keep the rank on the rows ([r, tokens], then [r, in] / [r, out]): MKL runs these
        # 2-5x faster than the same products with the rank as the output's last dimension
        # ((g B)^T x and g^T (x A^T)), which cost more than x's gradient itself on the demo shapes.
        grad_a = torch.mm(torch.mm(b.t(), g.t()), x2).mul_(ctx.scale)
        grad_b = torch.mm(torch.mm(a, x2.t()), g).mul_(ctx.scale).t()
        return grad_x, None, None, grad_a, grad_b, None


@dataclass
class LinearAdapter:
    """One job's adapter of one linear: its factors, scale and dropout."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    scale: float
    dropout: nn.Module


class LoRALinear(nn.Module):
    """A frozen linear plus a low-rank trainable update (the attached job's; none: the base alone)."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.enabled = True
        #: Off: always the low-rank path (bench/trainer_lora_matmul.py compares the two).
        self.merged_matmul = True
        self.attach(self.new_adapter(rank, scale, dropout, generator))

    def new_adapter(self, rank: int, scale: float, dropout: float, generator: torch.Generator) -> LinearAdapter:
        """A fresh adapter for this layer (A kaiming-uniform from ``generator``, B zero), not attached."""
        # Drawn on CPU, where the generator is, then moved: the same numbers on any device, however placed.
        a = torch.empty(rank, self.in_features, dtype=torch.float32)
        b = torch.empty(self.out_features, rank, dtype=torch.float32)
        _init_pair(a, b, generator)
        device = self.weight.device
        return LinearAdapter(nn.Parameter(a.to(device)), nn.Parameter(b.to(device)), scale,
                             nn.Dropout(dropout) if dropout > 0 else nn.Identity())

    def adapter(self) -> LinearAdapter | None:
        return None if self.lora_a is None else LinearAdapter(self.lora_a, self.lora_b, self.scale, self.dropout)

    def attach(self, adapter: LinearAdapter | None) -> None:
        """Makes ``adapter`` the one this layer applies (None: the base alone)."""
        self.lora_a = None if adapter is None else adapter.lora_a
        self.lora_b = None if adapter is None else adapter.lora_b
        self.scale = 0.0 if adapter is None else adapter.scale
        self.dropout = nn.Identity() if adapter is None else adapter.dropout

    @property
    def attached(self) -> bool:
        return self.lora_a is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.enabled and self.attached):
            return F.linear(x, self.weight, self.bias)
        if self._merged_matmul_applies(x):
            return _MergedLoRAMatmul.apply(x, self.weight, self.bias, self.lora_a, self.lora_b, self.scale)
        out = F.linear(x, self.weight, self.bias)
        # fp32 adapters are master weights; the update runs in the activation dtype (as AMP would), so
        # a bf16 model saves one bf16 input for backward, not an fp32 copy per projection.
        a, b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        delta = F.linear(F.linear(self.dropout(x), a), b) * self.scale
        return out + delta.to(out.dtype)

    def _merged_matmul_applies(self, x: torch.Tensor) -> bool:
        """fp32 throughout (a bf16 merge would round the small update away), no dropout (the update must
        see the same input as the base), a frozen base, no autocast (it would run the base in bf16)."""
        return (self.merged_matmul and x.dtype == self.weight.dtype == torch.float32
                and isinstance(self.dropout, nn.Identity) and not self.weight.requires_grad
                and not torch.is_autocast_enabled(x.device.type))

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in fp32."""
        return lora_delta(self.lora_a, self.lora_b, self.scale)

    def merged_weight(self, adapter: LinearAdapter | None = None) -> torch.Tensor:
        """W + scale * B @ A with ``adapter`` (default: the attached one), computed in fp32 and cast back; the
        base stays untouched (no adapter: W)."""
        adapter = adapter or self.adapter()
        if adapter is None:
            return self.weight
        return merge_lora(self.weight, adapter.lora_a, adapter.lora_b, adapter.scale)


@dataclass
class ExpertsAdapter:
    """One job's adapter of one MoE experts module: per projection, [E or 1, r, in] / [E or 1, out, r]."""

    lora_a: nn.ParameterDict
    lora_b: nn.ParameterDict
    scale: float
    dropout: nn.Module
    shared: bool


class LoRAExperts(nn.Module):
    """Qwen3-MoE experts (fused 3D weights) with LoRA on gate, up and down projections.

    Base layout (transformers >= 5): ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj``
    [E, H, I]. Adapters per projection are [E, r, in] / [E, out, r]; in shared mode the leading
    dimension is 1 and every expert uses the same adapter.
    """

    def __init__(self, base: nn.Module, rank: int, scale: float, dropout: float, shared: bool,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.num_experts = base.num_experts
        self.hidden_dim = base.hidden_dim
        self.intermediate_dim = base.intermediate_dim
        self.act_fn = base.act_fn
        self.gate_up_proj = base.gate_up_proj
        self.down_proj = base.down_proj
        self.gate_up_proj.requires_grad_(False)
        self.down_proj.requires_grad_(False)
        self.enabled = True
        self.attach(self.new_adapter(rank, scale, dropout, shared, generator))

    def new_adapter(self, rank: int, scale: float, dropout: float, shared: bool,
                    generator: torch.Generator) -> ExpertsAdapter:
        """A fresh adapter for these experts (one per expert, or one for all when ``shared``), not attached."""
        n = 1 if shared else self.num_experts
        device = self.gate_up_proj.device
        hid, inter = self.hidden_dim, self.intermediate_dim
        shapes = {"gate_proj": (hid, inter), "up_proj": (hid, inter), "down_proj": (inter, hid)}
        lora_a, lora_b = nn.ParameterDict(), nn.ParameterDict()
        for proj, (fan_in, fan_out) in shapes.items():
            a = torch.empty(n, rank, fan_in, dtype=torch.float32)  # drawn on CPU (the generator's), then moved
            b = torch.empty(n, fan_out, rank, dtype=torch.float32)
            _init_pair(a, b, generator)
            lora_a[proj], lora_b[proj] = nn.Parameter(a.to(device)), nn.Parameter(b.to(device))
        return ExpertsAdapter(lora_a, lora_b, scale, nn.Dropout(dropout) if dropout > 0 else nn.Identity(), shared)

    def adapter(self) -> ExpertsAdapter | None:
        if not self.attached:
            return None
        return ExpertsAdapter(self.lora_a, self.lora_b, self.scale, self.dropout, self.shared)

    def attach(self, adapter: ExpertsAdapter | None) -> None:
        """Makes ``adapter`` the one these experts apply (None: the base experts alone)."""
        self.lora_a = nn.ParameterDict() if adapter is None else adapter.lora_a
        self.lora_b = nn.ParameterDict() if adapter is None else adapter.lora_b
        self.scale = 0.0 if adapter is None else adapter.scale
        self.dropout = nn.Identity() if adapter is None else adapter.dropout
        self.shared = False if adapter is None else adapter.shared

    @property
    def attached(self) -> bool:
        return len(self.lora_a) > 0

    def _adapter(self, proj: str, expert: int, adapter: ExpertsAdapter | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        adapter = adapter or self.adapter()
        idx = 0 if adapter.shared else expert
        return adapter.lora_a[proj][idx], adapter.lora_b[proj][idx]

    def _lora(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        a, b = self._adapter(proj, expert)
        return F.linear(F.linear(self.dropout(x), a.to(x.dtype)), b.to(x.dtype)) * self.scale

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        inter = self.intermediate_dim
        for e in hit:
            top_k_pos, token_idx = torch.where(expert_mask[e])
            x = hidden_states[token_idx]
            gate_up = F.linear(x, self.gate_up_proj[e])
            gate, up = gate_up[..., :inter], gate_up[..., inter:]
            if self.enabled and self.attached:
                gate = gate + self._lora(x, "gate_proj", e)
                up = up + self._lora(x, "up_proj", e)
            h = self.act_fn(gate) * up
            out = F.linear(h, self.down_proj[e])
            if self.enabled and self.attached:
                out = out + self._lora(h, "down_proj", e)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def delta_weight(self, proj: str, expert: int) -> torch.Tensor:
        a, b = self._adapter(proj, expert)
        return lora_delta(a, b, self.scale)

    def merged_expert_weights(self, expert: int, adapter: ExpertsAdapter | None = None) -> dict[str, torch.Tensor]:
        """Per-expert HF weights (gate_proj, up_proj, down_proj) with ``adapter`` (default: the attached one)
        merged in fp32; no adapter: the base's."""
        adapter = adapter or self.adapter()
        if adapter is None:
            return self.base_expert_weights(expert)
        base = self.base_expert_weights(expert)
        return {p: merge_lora(w, *self._adapter(p, expert, adapter), adapter.scale) for p, w in base.items()}

    def base_expert_weights(self, expert: int) -> dict[str, torch.Tensor]:
        inter = self.intermediate_dim
        gate_up = self.gate_up_proj[expert]
        return {"gate_proj": gate_up[:inter], "up_proj": gate_up[inter:], "down_proj": self.down_proj[expert]}


def _is_experts(module: nn.Module) -> bool:
    return hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "num_experts")


@dataclass
class AdapterSlot:
    """One job's adapters across a model: what each LoRA layer applies while the job computes."""

    adapters: dict[str, LinearAdapter | ExpertsAdapter]


def activate(model: nn.Module, slot: AdapterSlot | None) -> None:
    """Attaches ``slot``'s adapters to the model's LoRA layers (every other layer runs its base alone)."""
    adapters = slot.adapters if slot is not None else {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear | LoRAExperts):
            module.attach(adapters.get(name))


def attach_lora(model: nn.Module, config: LoraSpec, seed: int = 0) -> AdapterSlot:
    """Freezes the base, adds adapters (drawn from ``seed``) to the target modules — wrapping those no earlier
    slot wrapped — and attaches them; returns the new slot. Earlier slots keep their adapters, detached."""
    activate(model, None)
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    targets = config.targets()
    adapters: dict[str, LinearAdapter | ExpertsAdapter] = {}
    for name, module in list(model.named_modules()):
        parent_name, _, child = name.rpartition(".")
        wrapper: LoRALinear | LoRAExperts
        if isinstance(module, LoRALinear) and child in targets:
            module.attach(module.new_adapter(config.rank, config.scale, config.dropout, generator))
            wrapper = module
        elif isinstance(module, nn.Linear) and child in targets:
            wrapper = LoRALinear(module, config.rank, config.scale, config.dropout, generator)
        elif isinstance(module, LoRAExperts) and config.expert_mode != "none":
            module.attach(module.new_adapter(config.rank, config.scale, config.dropout,
                                             config.expert_mode == "shared", generator))
            wrapper = module
        elif _is_experts(module) and config.expert_mode != "none":
            wrapper = LoRAExperts(module, config.rank, config.scale, config.dropout,
                                  shared=config.expert_mode == "shared", generator=generator)
        else:
            continue
        if wrapper is not module:
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, wrapper)
        adapters[name] = wrapper.adapter()
    if not adapters:
        raise ValueError(f"no module matched lora.target_modules={list(config.target_modules)}")
    slot = AdapterSlot(adapters)
    activate(model, slot)
    return slot


def inject_lora(model: nn.Module, config: LoraSpec, seed: int = 0) -> list[str]:
    """Freezes every base parameter and swaps target modules for LoRA layers (adapters drawn from ``seed``);
    returns their names."""
    return list(attach_lora(model, config, seed).adapters)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear | LoRAExperts]]:
    """The LoRA layers with an adapter attached (the active job's)."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear | LoRAExperts) and module.attached:
            yield name, module


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, m in lora_modules(model) for n, p in m.named_parameters() if "lora_" in n]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The reference policy: the base model with every adapter switched off (no second copy)."""
    modules = [m for _, m in lora_modules(model)]
    previous = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, was in zip(modules, previous, strict=True):
            m.enabled = was


def _slot_modules(model: nn.Module, slot: AdapterSlot | None
                  ) -> Iterator[tuple[str, LoRALinear | LoRAExperts, LinearAdapter | ExpertsAdapter]]:
    """The LoRA layers ``slot`` adapts (None: the attached adapters), each with its adapter."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear | LoRAExperts):
            adapter = module.adapter() if slot is None else slot.adapters.get(name)
            if adapter is not None:
                yield name, module, adapter


def peft_state_dict(model: nn.Module, slot: AdapterSlot | None = None) -> dict[str, torch.Tensor]:
    """Adapter tensors in PEFT names (``slot``'s, default the attached ones); MoE adapters written per expert
    (shared ones repeated). Reading a slot needs no turn on a shared base: its tensors are its own."""
    out: dict[str, torch.Tensor] = {}
    for name, module, adapter in _slot_modules(model, slot):
        if isinstance(module, LoRALinear):
            out[tensor_name(name, "A")] = adapter.lora_a.detach()
            out[tensor_name(name, "B")] = adapter.lora_b.detach()
            continue
        for e in range(module.num_experts):
            for proj in EXPERT_PROJS:
                a, b = module._adapter(proj, e, adapter)
                out[tensor_name(f"{name}.{e}.{proj}", "A")] = a.detach()
                out[tensor_name(f"{name}.{e}.{proj}", "B")] = b.detach()
    return out


def load_peft_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of peft_state_dict; every adapter tensor must be present with its exact shape."""
    expected = peft_state_dict(model)
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"adapter tensors do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, have in expected.items():
        if tuple(tensors[key].shape) != tuple(have.shape):
            got = tuple(tensors[key].shape)
            raise ValueError(f"adapter tensor {key} has shape {got}, expected {tuple(have.shape)}")
    with torch.no_grad():
        for name, module in lora_modules(model):
            if isinstance(module, LoRALinear):
                module.lora_a.copy_(tensors[tensor_name(name, "A")])
                module.lora_b.copy_(tensors[tensor_name(name, "B")])
                continue
            experts = [0] if module.shared else range(module.num_experts)
            for e in experts:
                for proj in EXPERT_PROJS:
                    module.lora_a[proj][e].copy_(tensors[tensor_name(f"{name}.{e}.{proj}", "A")])
                    module.lora_b[proj][e].copy_(tensors[tensor_name(f"{name}.{e}.{proj}", "B")])


def iter_merged_weights(model: nn.Module, merge: bool = True, slot: AdapterSlot | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the model in HF checkpoint names, layer by layer, adapters merged in fp32 (``slot``'s,
    default the attached ones: a slot's merge needs no turn on a shared base).

    Nothing is materialised beyond the tensor being yielded; the trained base is never modified.
    Fused expert tensors are split back into per-expert HF names (``mlp.experts.{e}.gate_proj.weight``).
    Tied weights (lm_head tied to embed_tokens) are yielded once, under their first name.
    """
    adapters = {name: adapter for name, _, adapter in _slot_modules(model, slot)}
    seen: set[int] = {id(p) for p in lora_parameters(model)}
    for mod_name, module in list(model.named_modules()):
        prefix = f"{mod_name}." if mod_name else ""
        if mod_name.rpartition(".")[2] in ("lora_a", "lora_b"):
            continue  # an attached job's expert adapters (another job may hold the turn while a slot is read)
        if isinstance(module, LoRAExperts):
            adapter = adapters.get(mod_name) if merge else None
            for e in range(module.num_experts):
                weights = module.merged_expert_weights(e, adapter) if adapter else module.base_expert_weights(e)
                for proj in EXPERT_PROJS:
                    yield f"{prefix}{e}.{proj}.weight", weights[proj].detach()
            seen.update({id(module.gate_up_proj), id(module.down_proj)})
            continue
        if _is_experts(module):
            for e in range(module.num_experts):
                inter = module.intermediate_dim
                gate_up = module.gate_up_proj[e]
                yield f"{prefix}{e}.gate_proj.weight", gate_up[:inter].detach()
                yield f"{prefix}{e}.up_proj.weight", gate_up[inter:].detach()
                yield f"{prefix}{e}.down_proj.weight", module.down_proj[e].detach()
            seen.update({id(module.gate_up_proj), id(module.down_proj)})
            continue
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen or pname.startswith("lora_"):
                continue
            seen.add(id(param))
            adapter = adapters.get(mod_name)
            if isinstance(module, LoRALinear) and pname == "weight" and merge and adapter is not None:
                yield f"{prefix}weight", module.merged_weight(adapter).detach()
            else:
                yield f"{prefix}{pname}", param.detach()
