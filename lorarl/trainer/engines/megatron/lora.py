"""LoRA on megatron-core's tensor-parallel linears (attention, dense MLP and SequentialMLP experts).

Each adapted ColumnParallelLinear / RowParallelLinear keeps its frozen base and gains a forward hook
adding ``scale * B(A(dropout(x)))``. The A/B split follows the base layer's own layout, so any TP size
computes exactly what TP=1 computes (sequence parallel off):

* column-parallel (linear_qkv, linear_fc1; weight split on its output rows): A [r, in] replicated,
  B split on rows like the weight (fc1 keeps ``[gate_r; up_r]``). ``h = A x`` is full on every rank;
  its gradient is all-reduced over TP (each rank's B shard sees only its output slice), which gives
  every rank the full dA and the full LoRA share of dx — the base layer all-reduces its own share.
* row-parallel (linear_proj, linear_fc2; input split on the last dim): A split on its input columns
  like the weight, B [out, r] replicated. ``h_r = A_r x_r`` is a partial sum, all-reduced forward
  (identity backward) before B — an [tokens, r] all-reduce instead of adding into the base's
  [tokens, out] one, with the same result.
* experts whose base skips the TP reduction (megatron's ``explicit_expert_comm``: the token
  dispatcher sums partial outputs over expert-TP ranks instead) get the same partial products as
  their base, and the replicated tensor's gradient is summed over expert-TP instead.

Adapters are fp32 master weights named by their full-model (TP/EP/PP independent) megatron names,
``decoder.layers.{L}.self_attention.linear_qkv.lora_A``; experts by global expert index, shared
expert adapters as ``decoder.layers.{L}.mlp.experts.shared.linear_fc1.lora_A``. `MegatronLora`
gathers every rank's shards (TP, EP, pipeline stages) into full tensors (for export and checkpoints),
scatters them back, and sums gradients over the data-parallel groups (see `sync_gradients`).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lorarl.trainer.engines.megatron import convert
from lorarl.trainer.engines.plain_collectives import all_gather_plain, all_gather_tensors
from lorarl.trainer.rl.lora import LoraConfig

QKV, FC1 = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
# megatron module (leaf name) -> the HF projections it fuses
FUSED_TARGETS = {"linear_qkv": QKV, "linear_proj": ("o_proj",), "linear_fc1": FC1, "linear_fc2": ("down_proj",)}


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (a replicated tensor used with a shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # megatron's _reduce silently skips non-contiguous tensors
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumForward(torch.autograd.Function):
    """Sums partial results over ``group`` forward; identity backward (every rank gets the same grad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_grad(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if _group_size(group) == 1 else _SumGrad.apply(x, group)


def sum_forward(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if _group_size(group) == 1 else _SumForward.apply(x, group)


def init_seed(seed: int, name: str) -> int:
    """A per-adapter init seed, so every TP/EP/PP layout draws the same full tensors."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@dataclass
class AdapterSpec:
    """Where one adapter sits: its name, its base weight's full-model name and how it is split."""

    name: str  # full-model adapter name (no .lora_A/.lora_B suffix)
    weight_name: str  # full-model name of the base weight (decides the TP split, see convert.tp_shard)
    kind: str  # "column" or "row"
    in_features: int  # full (unsharded) sizes
    out_features: int
    tp_group: dist.ProcessGroup | None
    explicit_comm: bool  # base leaves the TP reduction to the MoE token dispatcher
    ep_names: list[str] = field(default_factory=list)  # per-expert: this adapter's name on each EP rank
    shared_over: dist.ProcessGroup | None = None  # shared expert adapter: summed over EP ranks
    expert: bool = False  # on MoE experts (its gradient is reduced over the expert-data-parallel group)
    grad_scale: float = 1.0  # experts under TP without sequence parallel see every token tp times


class ParallelLora(nn.Module):
    """The trainable pair of one adapted parallel linear, as this rank holds it (fp32)."""

    def __init__(self, spec: AdapterSpec, rank: int, scale: float, dropout: float, seed: int,
                 device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.rank = rank
        self.scale = scale
        self.enabled = True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.tp_size = _group_size(spec.tp_group)
        self.tp_rank = dist.get_rank(spec.tp_group) if self.tp_size > 1 else 0
        generator = torch.Generator().manual_seed(init_seed(seed, spec.name))
        bound = 1.0 / math.sqrt(spec.in_features)
        full_a = torch.empty(rank, spec.in_features).uniform_(-bound, bound, generator=generator)
        full_b = torch.zeros(spec.out_features, rank)
        self.lora_a = nn.Parameter(self.shard("a", full_a).to(device))
        self.lora_b = nn.Parameter(self.shard("b", full_b).to(device))

    def sharded(self, which: str) -> bool:
        """Column layers split B (like the weight's rows), row layers split A (like its columns)."""
        return self.tp_size > 1 and (which == "b") == (self.spec.kind == "column")

    def shard(self, which: str, full: torch.Tensor) -> torch.Tensor:
        if not self.sharded(which):
            return full.clone()
        return convert.tp_shard(self.spec.weight_name, full, self.tp_rank, self.tp_size).clone()

    def gather(self, which: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every TP rank's ``local`` shard (a collective over the TP group)."""
        if not self.sharded(which):
            return local.detach().clone()
        shards = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(shards, local.detach().contiguous(), group=self.spec.tp_group)
        return convert.tp_merge(self.spec.weight_name, shards)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A dropout(x)`` laid out like the base output on this rank (see module docstring)."""
        group, explicit = self.spec.tp_group, self.spec.explicit_comm
        x = self.dropout(x)
        a, b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        if self.spec.kind == "column":
            h = F.linear(x, sum_grad(a, group)) if explicit else sum_grad(F.linear(x, a), group)
            return F.linear(h, b) * self.scale
        h = F.linear(x, a)
        if explicit:
            return F.linear(h, sum_grad(b, group)) * self.scale
        return F.linear(sum_forward(h, group), b) * self.scale


class _Hook:
    """Forward hook adding an adapter's delta to a parallel linear's (output, bias) tuple."""

    def __init__(self, adapter: ParallelLora) -> None:
        self.adapter = adapter

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        if not self.adapter.enabled:
            return output
        if kwargs.get("weight") is not None or kwargs.get("runtime_gather_output") or getattr(
                module, "gather_output", False):
            raise NotImplementedError("LoRA supports parallel linears with their own weight and no gathered output")
        x = args[0] if args else kwargs["input_"]
        if self.adapter.spec.kind == "row" and not module.input_is_parallel:
            from megatron.core.tensor_parallel import scatter_to_tensor_model_parallel_region

            x = scatter_to_tensor_model_parallel_region(x, group=self.adapter.spec.tp_group)
        out, bias = output
        return out + self.adapter.delta(x).to(out.dtype), bias


def _kind(module: nn.Module) -> str:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    raise TypeError(f"{type(module).__name__} is not a megatron ColumnParallelLinear / RowParallelLinear")


def adapter_spec(module: nn.Module, name: str, weight_name: str) -> AdapterSpec:
    """The AdapterSpec of a megatron parallel linear whose full-model names are given."""
    kind = _kind(module)
    if getattr(module, "sequence_parallel", False):
        raise NotImplementedError("LoRA on megatron layers needs sequence_parallel off")
    return AdapterSpec(name=name, weight_name=weight_name, kind=kind, in_features=module.input_size,
                       out_features=module.output_size, tp_group=module.tp_group,
                       explicit_comm=bool(getattr(module, "explicit_expert_comm", False)))


def add_lora(module: nn.Module, spec: AdapterSpec, config: LoraConfig, seed: int,
             owner: nn.Module | None = None) -> ParallelLora:
    """A new adapter registered as ``module.lora`` (or on ``owner``, for shared ones) and hooked onto ``module``."""
    adapter = ParallelLora(spec, config.rank, config.scale, config.dropout, seed, module.weight.device)
    if owner is None:
        module.add_module("lora", adapter)
    else:
        owner.add_module(f"lora_{spec.name.rsplit('.', 1)[1]}", adapter)
    hook_lora(module, adapter)
    return adapter


def hook_lora(module: nn.Module, adapter: ParallelLora) -> None:
    """Makes ``module`` add ``adapter``'s delta to its output (several modules may share one adapter)."""
    module.register_forward_hook(_Hook(adapter), with_kwargs=True)


def adapted_modules(config: LoraConfig) -> frozenset[str]:
    """The megatron leaf modules the job's HF target names select; fused ones need all or none of theirs."""
    targets = config.targets()
    chosen = set()
    for leaf, hf in FUSED_TARGETS.items():
        hit = targets & set(hf)
        if hit and hit != set(hf):
            raise ValueError(f"lora.target_modules: megatron fuses {list(hf)} into {leaf}; target all of them or none "
                             f"(got {sorted(hit)})")
        if hit:
            chosen.add(leaf)
    return frozenset(chosen)


class MegatronLora:
    """Every adapter of one rank's megatron model, with the collectives that make them whole.

    Iteration order is the same on every rank of a TP, EP or data-parallel group (layers, then local
    experts), which is what lets `gather` and `sync_gradients` pair up collectives without exchanging
    names. Groups left None have size 1. Construction is a collective over ``pp_group``: every stage
    learns the whole model's adapter shapes once, so later size queries need no communication.
    """

    def __init__(self, adapters: list[ParallelLora], ep_group: dist.ProcessGroup | None = None,
                 dp_group: dist.ProcessGroup | None = None, expert_dp_group: dist.ProcessGroup | None = None,
                 pp_group: dist.ProcessGroup | None = None) -> None:
        self.adapters = adapters
        self.ep_group = ep_group
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        self.pp_group = pp_group
        shapes: dict[str, tuple[int, ...]] = {}
        for ad in adapters:
            for peer in ad.spec.ep_names or [ad.spec.name]:
                shapes[f"{peer}.lora_A"] = (ad.rank, ad.spec.in_features)
                shapes[f"{peer}.lora_B"] = (ad.spec.out_features, ad.rank)
        self.full_shapes = {k: v for stage in self._over_stages(shapes) for k, v in stage.items()}

    def _over_stages(self, obj: Any) -> list[Any]:
        """``obj`` of every pipeline stage (this rank's alone without pipeline parallelism)."""
        if _group_size(self.pp_group) == 1:
            return [obj]
        return all_gather_plain(obj, self.pp_group)

    # ------------------------------------------------------------ parameters

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's adapter parameters under their full-model names."""
        out: dict[str, nn.Parameter] = {}
        for ad in self.adapters:
            out[f"{ad.spec.name}.lora_A"] = ad.lora_a
            out[f"{ad.spec.name}.lora_B"] = ad.lora_b
        return out

    def locate(self) -> dict[str, tuple[ParallelLora, str]]:
        """Parameter name -> (adapter, "a" | "b")."""
        return {f"{ad.spec.name}.lora_{w.upper()}": (ad, w) for ad in self.adapters for w in ("a", "b")}

    def full_names(self) -> list[str]:
        """Every adapter parameter name of the whole model (all EP ranks and stages), rank-independent order."""
        return sorted(self.full_shapes)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The reference policy: every adapter off (no second model copy)."""
        previous = [ad.enabled for ad in self.adapters]
        for ad in self.adapters:
            ad.enabled = False
        try:
            yield
        finally:
            for ad, was in zip(self.adapters, previous, strict=True):
                ad.enabled = was

    # ------------------------------------------------------------ gather / scatter

    def gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors of the whole model from tensors shaped like this rank's parameters (a collective
        every rank of the model-parallel group must join, e.g. parameters or Adam moments)."""
        where = self.locate()
        out: dict[str, torch.Tensor] = {}
        for name, (ad, which) in where.items():
            full = ad.gather(which, local[name])
            if ad.spec.ep_names and _group_size(self.ep_group) > 1:
                peers = [torch.empty_like(full) for _ in ad.spec.ep_names]
                dist.all_gather(peers, full.contiguous(), group=self.ep_group)
                suffix = name.rsplit(".", 1)[1]
                out.update({f"{peer}.{suffix}": t for peer, t in zip(ad.spec.ep_names, peers, strict=True)})
            else:
                out[name] = full
        if _group_size(self.pp_group) == 1:
            return out
        device = next(iter(out.values())).device
        stages = all_gather_tensors({k: v.cpu() for k, v in out.items()}, self.pp_group)
        return {k: v.to(device) for stage in stages for k, v in stage.items()}

    def full_tensors(self) -> dict[str, torch.Tensor]:
        return self.gather({n: p.detach() for n, p in self.named_parameters().items()})

    def shard(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slices of full tensors (no communication)."""
        return {name: ad.shard(which, full[name]) for name, (ad, which) in self.locate().items()}

    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        params = self.named_parameters()
        with torch.no_grad():
            for name, value in self.shard(full).items():
                params[name].copy_(value)

    # ------------------------------------------------------------ gradients

    def reduction_groups(self, ad: ParallelLora) -> list[dist.ProcessGroup]:
        """The groups whose SUM turns this rank's gradient of ``ad`` into the whole batch's (see sync_gradients)."""
        if not ad.spec.expert:
            groups = [self.dp_group]
        elif ad.spec.ep_names:
            groups = [self.expert_dp_group]
        else:
            groups = [ad.spec.shared_over, self.expert_dp_group]
        return [g for g in groups if _group_size(g) > 1]

    def sync_gradients(self) -> None:
        """Makes every rank's adapter gradients the whole batch's, each rank having backpropagated its own share.

        * non-expert adapters saw only this data-parallel rank's tokens: SUM over the data-parallel group;
        * per-expert adapters: the allgather dispatcher brings every token of the TP x EP group to the rank
          owning the expert, so only the expert-data-parallel replicas (other token sets) remain to be summed;
        * shared expert adapters saw the tokens of the TP x EP group but only through this rank's local
          experts: SUM over EP (the other experts), then over expert-data-parallel.

        Before that, expert gradients are scaled by ``grad_scale`` (duplicate tokens under TP, see inject).
        One flat all-reduce per group.
        """
        buckets: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
        for ad in self.adapters:
            if ad.spec.grad_scale != 1.0:
                for p in (ad.lora_a, ad.lora_b):
                    p.grad.mul_(ad.spec.grad_scale)
            for g in self.reduction_groups(ad):
                buckets.setdefault(id(g), (g, []))[1].extend([ad.lora_a.grad, ad.lora_b.grad])
        for group, grads in buckets.values():
            flat = torch.cat([t.reshape(-1) for t in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for t in grads:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of every adapter gradient, each element counted once across ranks (after
        `sync_gradients`, data-parallel replicas hold the same gradients and are counted once)."""
        buckets: dict[tuple[int, ...], tuple[list[dist.ProcessGroup], torch.Tensor]] = {}
        for ad in self.adapters:
            for which, p in (("a", ad.lora_a), ("b", ad.lora_b)):
                groups = [ad.spec.tp_group] if ad.sharded(which) else []
                if ad.spec.ep_names and _group_size(self.ep_group) > 1:
                    groups.append(self.ep_group)
                key = tuple(id(g) for g in groups)
                sq = p.grad.detach().float().pow(2).sum()
                buckets[key] = (groups, buckets[key][1] + sq if key in buckets else sq)
        total = []
        for groups, sq in buckets.values():
            for g in groups:  # orthogonal groups: summing over each in turn sums over their product
                dist.all_reduce(sq, group=g)
            total.append(sq)
        stage = torch.stack(total).sum()
        if _group_size(self.pp_group) > 1:  # stages hold disjoint layers
            dist.all_reduce(stage, group=self.pp_group)
        return stage.sqrt()


def inject_megatron_lora(model: nn.Module, config: LoraConfig, seed: int,
                         layout: convert.Qwen3Layout) -> MegatronLora:
    """Freezes the model and hooks LoRA onto the targeted parallel linears; returns the adapters."""
    from megatron.core import parallel_state as ps

    model.requires_grad_(False)
    coords = convert.RankCoords.current()
    ep_group = ps.get_expert_model_parallel_group() if coords.ep_size > 1 else None
    leaves = adapted_modules(config)
    # megatron's token dispatchers gather tokens over TP x EP. Without sequence parallelism every TP rank
    # holds the same tokens, so each expert processes each token tp times (once per TP rank's copy, each
    # with that rank's identical loss gradient): the outputs come back right, expert gradients tp-fold.
    sequence_parallel = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
    expert_grad_scale = 1.0 if sequence_parallel else 1.0 / coords.tp_size
    adapters: list[ParallelLora] = []
    shared: dict[str, ParallelLora] = {}
    for local, module in list(model.named_modules()):
        leaf = local.rsplit(".", 1)[-1]
        if leaf not in FUSED_TARGETS or not local.startswith("decoder.layers."):
            continue
        full = convert.global_name(f"{local}.weight", layout, coords)[: -len(".weight")]
        if ".mlp.experts.local_experts." not in local:
            if leaf in leaves:
                adapters.append(add_lora(module, adapter_spec(module, full, f"{full}.weight"), config, seed))
            continue
        if config.expert_mode == "none":
            continue
        experts_name, _, rest = local.partition(".local_experts.")
        module_spec = adapter_spec(module, full, f"{full}.weight")
        module_spec.grad_scale, module_spec.expert = expert_grad_scale, True
        layer_prefix = full.partition(".local_experts.")[0]
        if config.expert_mode == "per_expert":
            spec = module_spec
            per, local_idx = layout.num_experts // coords.ep_size, int(rest.split(".")[0])
            spec.ep_names = [f"{layer_prefix}.local_experts.{r * per + local_idx}.{leaf}"
                             for r in range(coords.ep_size)]
            adapters.append(add_lora(module, spec, config, seed))
            continue
        name = f"{layer_prefix}.shared.{leaf}"
        if name in shared:
            hook_lora(module, shared[name])
            continue
        spec = module_spec
        spec.name, spec.shared_over = name, ep_group
        shared[name] = add_lora(module, spec, config, seed, owner=model.get_submodule(experts_name))
        adapters.append(shared[name])
    if not adapters:
        raise ValueError(f"no megatron module matched lora.target_modules={list(config.target_modules)}")
    return MegatronLora(adapters, ep_group, dp_group=ps.get_data_parallel_group(),
                        expert_dp_group=ps.get_expert_data_parallel_group(),
                        pp_group=ps.get_pipeline_model_parallel_group() if coords.pp_size > 1 else None)
