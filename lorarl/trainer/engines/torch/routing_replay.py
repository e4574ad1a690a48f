"""Routing replay (R3) in the torch engine: the trainer's MoE routers use the experts the rollout chose.

A trajectory's routes (lorarl.contract.routes: experts per position and MoE layer, -1 where not recorded) go
into PackedBatch.routes [B, L, layers, k] (int16, aligned with input_ids). Each decoder call of the engine then
passes ``routing_replay`` [layers, rows, k] for its own token layout (rows = the call's [batch, seq] flattened):
the plain forward's rows, or the shared-prompt forward's prompt pass and completion pass
(lorarl.trainer.engines.torch.prefix_sharing), whose slots map back to (row, position) here.

Installed once per base model (``install``):

    decoder layer   takes the ``routing_replay`` keyword transformers hands every layer, gives the router its
                    slice for the call, and clears it after. Installed beneath the activation-checkpointing
                    wrapper (lorarl.trainer.engines.recompute), so a recomputed layer gets the same slice again.
    router          the live router's logits and softmax as always; where a row has a recorded route its
                    experts are the recorded ones, their weights gathered from the live probabilities and
                    renormalised as ``norm_topk_prob`` says, so gradients still reach the router. Rows without
                    a route (-1: padding, not recorded) keep the live top-k.

Which experts a replaying row takes is lorarl.trainer.rl.routing's rule (the Megatron engine applies the same).
Each replaying call also counts how often the live router would have chosen another expert set (per token and
layer, and per token in any layer): `take_counts` reads them, and lorarl.trainer.rl.routing.metrics_from_counts
makes the step's ``routing_*`` metrics of them.
Routers are transformers' top-k routers (Qwen3-MoE's ``Qwen3MoeTopKRouter``): ``weight``, ``top_k``,
``num_experts``, ``norm_topk_prob``, forward -> (logits, weights, indices).

The Megatron engine replays the same routes by the same rule through megatron-core's router hook
(lorarl.trainer.engines.megatron.routing_replay).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lorarl.contract.routes import RoutedExperts
from lorarl.trainer.engines.recompute import decoder_layers
from lorarl.trainer.rl.batching import PackedBatch
from lorarl.trainer.rl.routing import select_experts
from lorarl.trainer.rl.trajectory import TrajectoryRecord

_INSTALLED = "_lorarl_routing_replay"
_ROUTER_ATTRS = ("weight", "top_k", "num_experts", "norm_topk_prob")


def _router(layer: nn.Module) -> nn.Module | None:
    gate = getattr(getattr(layer, "mlp", None), "gate", None)
    if gate is not None and all(hasattr(gate, a) for a in _ROUTER_ATTRS) and type(gate).__name__.endswith("Router"):
        return gate
    return None


def moe_layers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(decoder layer, its top-k router) of every MoE layer, in layer order."""
    try:
        layers = decoder_layers(model)
    except TypeError:
        return []
    return [(layer, router) for layer in layers if (router := _router(layer)) is not None]


def route_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, top_k, experts) of a model whose routers this module can replay; None: none to replay."""
    found = moe_layers(model)
    if not found:
        return None
    router = found[0][1]
    return len(found), int(router.top_k), int(router.num_experts)


@dataclass
class _Seen:
    """One replaying call of one router: tokens with a route, and which of them the live router disagrees on."""

    replayed: torch.Tensor  # [rows] bool
    differs: torch.Tensor  # [rows] bool


def _replaying_router_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    values, indices = torch.topk(probs, self.top_k, dim=-1)
    if self._lorarl_capture is not None:
        self._lorarl_capture.append(indices.detach().cpu())
    replay = self._lorarl_replay
    if replay is not None:
        indices, recorded, differs = select_experts(indices, replay)
        values = probs.gather(-1, indices)
        # keyed by the forward (`_pass_key`): a recomputed layer (activation checkpointing) overwrites
        self._lorarl_seen[self._lorarl_key] = _Seen(recorded.detach().cpu(), differs.detach().cpu())
    if self.norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return logits, values.to(logits.dtype), indices


_PASSES = itertools.count(1)


def _pass_key(routing_replay: torch.Tensor | None) -> int:
    """The forward a layer call belongs to: a number stamped on the routes tensor the model hands every layer,
    so a recomputed layer (activation checkpointing reruns it with the same tensor) overwrites its entry and a
    new forward never shares one (an ``id`` would: a freed tensor's id is reused by the next pass's)."""
    if routing_replay is None:
        return 0
    key = getattr(routing_replay, "_lorarl_pass", None)
    if key is None:
        key = next(_PASSES)
        routing_replay._lorarl_pass = key
    return key


def _replaying_layer_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any,
                             routing_replay: torch.Tensor | None = None, **kwargs: Any) -> Any:
    router = self.mlp.gate
    router._lorarl_replay = None if routing_replay is None else routing_replay[self._lorarl_moe_index]
    router._lorarl_key = _pass_key(routing_replay)
    try:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    finally:
        router._lorarl_replay = None


def install(model: nn.Module) -> int:
    """Makes every MoE layer of ``model`` take ``routing_replay`` (see the module docstring); returns how many.
    Call before activation checkpointing wraps the layers. Calls without the keyword route live, as before."""
    found = moe_layers(model)
    for index, (layer, router) in enumerate(found):
        if getattr(layer, _INSTALLED, False):
            continue
        router._lorarl_replay = None
        router._lorarl_capture = None
        router._lorarl_seen = {}
        router.forward = types.MethodType(_replaying_router_forward, router)
        layer._lorarl_moe_index = index
        layer.forward = types.MethodType(_replaying_layer_forward, layer)
        setattr(layer, _INSTALLED, True)
    return len(found)


def take_counts(model: nn.Module) -> tuple[int, int, int, int]:
    """The replaying calls since the last take, as counts: replayed (token, layer) pairs, those whose live top-k
    set differs, replayed token rows (per call), and those where any layer's differs. Counts, not ratios, so
    data-parallel ranks can sum them first (`metrics_from_counts` takes the ratios)."""
    found = moe_layers(model)
    calls: dict[int, list[_Seen]] = {}
    for _, router in found:
        seen = getattr(router, "_lorarl_seen", {})
        for key, s in seen.items():
            calls.setdefault(key, []).append(s)
        seen.clear()
    pairs = differing = tokens = any_differs = 0
    for per_layer in calls.values():
        if len(per_layer) != len(found) or len({s.replayed.shape for s in per_layer}) != 1:
            continue
        replayed = torch.stack([s.replayed for s in per_layer])  # [layers, rows]
        differs = torch.stack([s.differs for s in per_layer])
        pairs += int(replayed.sum())
        differing += int(differs.sum())
        rows = replayed.any(0)
        tokens += int(rows.sum())
        any_differs += int(differs.any(0).sum())
    return pairs, differing, tokens, any_differs


@torch.no_grad()
def live_routes(model: nn.Module, records: Sequence[TrajectoryRecord]) -> list[RoutedExperts]:
    """The experts the model's own routers choose for each record's positions (prompt + completion but the
    last), one plain forward per record: what the trainer routes without replay (benchmarks and tests hold the
    rollout's recorded routes against it). ``install`` must have run."""
    found = moe_layers(model)
    if not found:
        raise ValueError("the model has no MoE router to record")
    experts = int(found[0][1].num_experts)
    out = []
    try:
        for r in records:
            ids = list(r.prompt_token_ids) + list(r.completion_token_ids)[:-1]
            for _, router in found:
                router._lorarl_capture = []
            device = next(model.parameters()).device
            model.get_decoder()(input_ids=torch.tensor([ids], device=device), use_cache=False)
            layers = [router._lorarl_capture[0] for _, router in found]  # [positions, k] each
            out.append(RoutedExperts(torch.stack(layers, dim=1).to(torch.int16).numpy(), experts))
    finally:
        for _, router in found:
            router._lorarl_capture = None
    return out


# ---------------------------------------------------------------- replay tensors per decoder call


def _gather(routes: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[layers, slots, k]: routes[rows, positions] where ``real``, else -1."""
    picked = routes[rows.clamp(min=0), positions.clamp(min=0, max=routes.shape[1] - 1)]  # [slots, layers, k]
    picked = torch.where(real.view(-1, 1, 1), picked, torch.full_like(picked, -1))
    return picked.permute(1, 0, 2).contiguous()


def plain_replay(batch: PackedBatch) -> torch.Tensor | None:
    """The plain forward's: its rows are the batch's [B, L] input."""
    if batch.routes is None:
        return None
    B, L = batch.input_ids.shape
    return batch.routes.reshape(B * L, *batch.routes.shape[2:]).permute(1, 0, 2).contiguous()


def prompt_pass_replay(batch: PackedBatch, row_prompt: torch.Tensor, prompt_lengths: torch.Tensor, width: int
                       ) -> torch.Tensor | None:
    """The shared-prompt forward's prompt pass [G, width]: each distinct prompt's positions, from the first row
    that continues it (its group's rows were all sampled after the same prompt)."""
    if batch.routes is None:
        return None
    device = batch.routes.device
    groups = prompt_lengths.shape[0]
    first = torch.full((groups,), batch.size, dtype=torch.long, device=device)
    first.scatter_reduce_(0, row_prompt.to(device), torch.arange(batch.size, device=device), reduce="amin")
    steps = torch.arange(width, device=device)
    rows = first.unsqueeze(1).expand(groups, width).reshape(-1)
    positions = steps.repeat(groups)
    real = (steps.unsqueeze(0) < prompt_lengths.to(device).unsqueeze(1)).reshape(-1)
    return _gather(batch.routes, rows, positions, real)


def completion_pass_replay(batch: PackedBatch, row_start: torch.Tensor, slots: int, row_len: torch.Tensor
                           ) -> torch.Tensor | None:
    """The completion pass over ``slots`` slots: row b's completion input j sits at slot row_start[b] + j and is
    the token at position row_len[b] + j (padded rows: row_start = b * width; packed lines: first fit)."""
    if batch.routes is None:
        return None
    device = batch.routes.device
    W = batch.completion_ids.shape[1] - 1
    steps = torch.arange(max(W, 0), device=device)
    real = steps < (batch.completion_lengths.to(device).unsqueeze(1) - 1)  # [B, W]
    slot = (row_start.to(device).unsqueeze(1) + steps)[real]
    rows = torch.full((slots,), -1, dtype=torch.long, device=device)
    positions = torch.zeros(slots, dtype=torch.long, device=device)
    rows[slot] = torch.arange(batch.size, device=device).unsqueeze(1).expand_as(real)[real]
    positions[slot] = (row_len.to(device).reshape(-1, 1) + steps)[real]
    return _gather(batch.routes, rows, positions, rows >= 0)
