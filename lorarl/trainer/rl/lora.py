"""LoRA layers for dense linears and MoE experts, injected into a frozen transformers model.

A LoRA layer keeps the base weight under its original attribute name (``weight`` for a linear,
``gate_up_proj``/``down_proj`` for experts), so every base tensor keeps its Hugging Face name and
the merged model can be streamed in HF names. Adapters live in fp32 whatever the base dtype; the
low-rank update is computed in the activation dtype (fp32 master weights, as in mixed precision).

    y = x W^T + scale * dropout(x) A^T B^T,   scale = alpha / r   (rsLoRA: alpha / sqrt(r))
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

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


class LoRALinear(nn.Module):
    """A frozen linear plus a low-rank trainable update."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scale = scale
        self.enabled = True
        #: Off: always the low-rank path (bench/trainer_lora_matmul.py compares the two).
        self.merged_matmul = True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=torch.float32))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, rank, device=device, dtype=torch.float32))
        _init_pair(self.lora_a, self.lora_b, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
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

    def merged_weight(self) -> torch.Tensor:
        """W + scale * B @ A, computed in fp32 and cast back; the base stays untouched."""
        return merge_lora(self.weight, self.lora_a, self.lora_b, self.scale)


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
        self.scale = scale
        self.shared = shared
        self.enabled = True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        n = 1 if shared else self.num_experts
        device = base.gate_up_proj.device
        hid, inter = self.hidden_dim, self.intermediate_dim
        shapes = {"gate_proj": (hid, inter), "up_proj": (hid, inter), "down_proj": (inter, hid)}
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        for proj, (fan_in, fan_out) in shapes.items():
            a = nn.Parameter(torch.empty(n, rank, fan_in, device=device, dtype=torch.float32))
            b = nn.Parameter(torch.empty(n, fan_out, rank, device=device, dtype=torch.float32))
            _init_pair(a, b, generator)
            self.lora_a[proj], self.lora_b[proj] = a, b

    def _adapter(self, proj: str, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = 0 if self.shared else expert
        return self.lora_a[proj][idx], self.lora_b[proj][idx]

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
            if self.enabled:
                gate = gate + self._lora(x, "gate_proj", e)
                up = up + self._lora(x, "up_proj", e)
            h = self.act_fn(gate) * up
            out = F.linear(h, self.down_proj[e])
            if self.enabled:
                out = out + self._lora(h, "down_proj", e)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def delta_weight(self, proj: str, expert: int) -> torch.Tensor:
        a, b = self._adapter(proj, expert)
        return lora_delta(a, b, self.scale)

    def merged_expert_weights(self, expert: int) -> dict[str, torch.Tensor]:
        """Per-expert HF weights (gate_proj, up_proj, down_proj) with the adapter merged in fp32."""
        inter = self.intermediate_dim
        gate_up = self.gate_up_proj[expert]
        base = {"gate_proj": gate_up[:inter], "up_proj": gate_up[inter:], "down_proj": self.down_proj[expert]}
        return {p: merge_lora(w, *self._adapter(p, expert), self.scale) for p, w in base.items()}

    def base_expert_weights(self, expert: int) -> dict[str, torch.Tensor]:
        inter = self.intermediate_dim
        gate_up = self.gate_up_proj[expert]
        return {"gate_proj": gate_up[:inter], "up_proj": gate_up[inter:], "down_proj": self.down_proj[expert]}


def _is_experts(module: nn.Module) -> bool:
    return hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "num_experts")


def inject_lora(model: nn.Module, config: LoraSpec, seed: int = 0) -> list[str]:
    """Freezes every base parameter and swaps target modules for LoRA layers (adapters drawn from ``seed``);
    returns their names."""
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    targets = config.targets()
    replaced: list[str] = []
    for name, module in list(model.named_modules()):
        parent_name, _, child = name.rpartition(".")
        if isinstance(module, nn.Linear) and child in targets:
            new: nn.Module = LoRALinear(module, config.rank, config.scale, config.dropout, generator)
        elif _is_experts(module) and config.expert_mode != "none" and not isinstance(module, LoRAExperts):
            new = LoRAExperts(module, config.rank, config.scale, config.dropout,
                              shared=config.expert_mode == "shared", generator=generator)
        else:
            continue
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        replaced.append(name)
    if not replaced:
        raise ValueError(f"no module matched lora.target_modules={list(config.target_modules)}")
    return replaced


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear | LoRAExperts]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear | LoRAExperts):
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


PEFT_PREFIX = "base_model.model."


def peft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors in PEFT names; MoE adapters written per expert (shared ones repeated)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in lora_modules(model):
        if isinstance(module, LoRALinear):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = module.lora_a.detach()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = module.lora_b.detach()
            continue
        for e in range(module.num_experts):
            for proj in EXPERT_PROJS:
                a, b = module._adapter(proj, e)
                out[f"{PEFT_PREFIX}{name}.{e}.{proj}.lora_A.weight"] = a.detach()
                out[f"{PEFT_PREFIX}{name}.{e}.{proj}.lora_B.weight"] = b.detach()
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
                module.lora_a.copy_(tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"])
                module.lora_b.copy_(tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"])
                continue
            experts = [0] if module.shared else range(module.num_experts)
            for e in experts:
                for proj in EXPERT_PROJS:
                    module.lora_a[proj][e].copy_(tensors[f"{PEFT_PREFIX}{name}.{e}.{proj}.lora_A.weight"])
                    module.lora_b[proj][e].copy_(tensors[f"{PEFT_PREFIX}{name}.{e}.{proj}.lora_B.weight"])


def iter_merged_weights(model: nn.Module, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the model in HF checkpoint names, layer by layer, adapters merged in fp32.

    Nothing is materialised beyond the tensor being yielded; the trained base is never modified.
    Fused expert tensors are split back into per-expert HF names (``mlp.experts.{e}.gate_proj.weight``).
    Tied weights (lm_head tied to embed_tokens) are yielded once, under their first name.
    """
    seen: set[int] = {id(p) for p in lora_parameters(model)}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, LoRAExperts):
            for e in range(module.num_experts):
                weights = module.merged_expert_weights(e) if merge else module.base_expert_weights(e)
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
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, LoRALinear) and pname == "weight" and merge:
                yield f"{prefix}weight", module.merged_weight().detach()
            else:
                yield f"{prefix}{pname}", param.detach()
