"""Routing replay (R3) in the Megatron engine: megatron's MoE routers use the experts the rollout chose.

What is replayed, and the rule, are the torch engine's (lorarl.trainer.engines.torch.routing_replay): a batch's
routes (PackedBatch.routes [B, L, MoE layers, k], -1 where not recorded) name each token's experts per MoE
layer; a router takes the recorded experts where a row has a route, their weights from its LIVE scores (so
gradients still reach the router), and keeps its live top-k where the row is -1 (padding, not recorded).

The hook is megatron-core's own: a TopKRouter hands its top-k selection to ``router.router_replay``
(moe_utils.topk_routing_with_score_function calls ``get_replay_topk(scores, topk, ..., default_compute_topk)``).
`RecordedTopk` is such an object, one per router, with RouterReplay's ``get_replay_topk``. megatron's own
RouterReplay (``moe_enable_routing_replay``) is not used, because:

* REPLAY_FORWARD replaces every row with the target's; lorarl's -1 rows must keep the live top-k.
* its instances join a process-wide list (``RouterReplay.global_router_replay_instances``) that its static
  setters walk: every model built in the process would share one set of targets. So the config flag stays off
  and `install` gives each router a `RecordedTopk` that does not join the list.
* REPLAY_BACKWARD pops a queue filled once per forward, the caller switching a global action between forward
  and backward; lorarl's activation checkpointing (lorarl.trainer.engines.recompute: torch.utils.checkpoint
  around each TransformerLayer) recomputes inside autograd, where nothing switches it, and with 'auto' a layer
  may not recompute at all (the queue would grow). Here a forward's routes stay set until the next forward
  sets its own (`RouterReplays.set`): every forward runs one micro-batch and its backward follows before the
  next forward (the plain path's loss_backward, and the 1F1B schedule with one micro-batch), so a recomputed
  layer finds the same indices again.

Weights. With ``norm_topk_prob`` the config routes softmax after top-k (convert.transformer_config): the top-k
scores are the logits and megatron softmaxes the selected ones, so gathering the recorded experts' logits gives
softmax over them, which is the torch engine's live softmax gathered and renormalised. Without it (pre-softmax)
the scores are the live softmax, gathered unnormalised, again the torch engine's rule.

Token order. megatron's hidden states are [s, b, h] and the router flattens them sequence-major (row
``s * b + b_index``); lorarl's routes are batch-major [B, L]: `RouterReplays.set` pads them to the forward's
(lockstep-padded) [B', S'] with -1 and transposes them.

Parallelism. Pipeline: a stage holds its own layers only; a router's MoE index comes from its
TransformerLayer's global ``layer_number`` (1-based) and the layout's MoE layers, so its slice of the routes is
the global one. Tensor parallel (sequence parallelism off): every TP rank's router sees the micro-batch's
tokens whole and replays the same rows. Expert parallel (carved out of the data-parallel ranks): each rank
routes its own micro-batch before the allgather dispatcher gathers tokens, so each replays its own routes.
`routing_counts` adds the figures up: any-layer-per-token over the pipeline's stages, then sums over the
data-parallel ranks (TP ranks hold copies and are not summed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lorarl.contract.routes import RoutedExperts
from lorarl.trainer.engines.megatron.model import compute_logits
from lorarl.trainer.rl.routing import record_counts, select_experts
from lorarl.trainer.rl.trajectory import TrajectoryRecord

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from lorarl.trainer.engines.megatron.convert import Qwen3Layout

TopkFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Seen:
    """One replaying pass through one router: rows with a route, and which of them the live top-k differs on."""

    replayed: torch.Tensor  # [rows] bool
    differs: torch.Tensor  # [rows] bool


class RecordedTopk:
    """A router's top-k: the recorded experts on rows with a route, the live top-k elsewhere (module docstring).

    What megatron's TopKRouter.router_replay holds, in place of its RouterReplay (same ``get_replay_topk``; not a
    subclass, which would join its process-wide instance list and import megatron with this module).
    ``target_topk_idx`` [rows, k] (sequence-major, -1 rows: live) is set per forward by `RouterReplays.set`;
    None routes live."""

    def __init__(self, moe_index: int) -> None:
        self.target_topk_idx: torch.Tensor | None = None
        self.moe_index = moe_index
        self.pass_id = 0
        self.seen: dict[int, Seen] = {}
        self.capture: list[torch.Tensor] | None = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: TopkFn | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        values, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.capture is not None:
            self.capture.append(live.detach().cpu())
        target = self.target_topk_idx
        if target is None:
            return values, live
        indices, recorded, differs = select_experts(live, target)
        # keyed by the forward: a recomputed layer (activation checkpointing) overwrites, never adds; kept on the
        # device (no sync per layer) until `RouterReplays.take`
        self.seen[self.pass_id] = Seen(recorded.detach(), differs.detach())
        return scores.gather(1, indices), indices


class RouterReplays:
    """This rank's MoE routers with their `RecordedTopk`, and the replaying forwards since the last `take`."""

    def __init__(self, replays: list[RecordedTopk], shape: tuple[int, int, int] | None) -> None:
        self.replays = replays
        self.shape = shape  # (MoE layers of the whole model, top_k, experts); None: a dense model
        self._pass = 0
        self._rows: dict[int, int] = {}  # replaying forward -> its router rows (s * b)

    def set(self, routes: torch.Tensor | None, padded: tuple[int, int]) -> None:
        """The next forward's routes: ``routes`` [B, L, MoE layers, k] for input ids right/bottom-padded to
        ``padded`` [B', S'] (None: live routing). Every forward must call it, on every pipeline stage."""
        self._pass += 1
        targets = None if routes is None else self._targets(routes, padded)
        if targets is not None:
            self._rows[self._pass] = padded[0] * padded[1]
        for replay in self.replays:
            replay.pass_id = self._pass
            replay.target_topk_idx = None if targets is None else targets[replay.moe_index]

    def clear(self) -> None:
        """Drops the last forward's routes (they stay set through a backward, which may recompute the forward):
        ``routes`` are held only while a step or a logprob pass runs."""
        for replay in self.replays:
            replay.target_topk_idx = None

    def _targets(self, routes: torch.Tensor, padded: tuple[int, int]) -> torch.Tensor:
        """[MoE layers, S' * B', k] int32 (half of long's bytes; `torch.where` promotes it against the live ids):
        ``routes`` padded with -1, sequence-major as megatron's router rows."""
        if self.shape is None or routes.shape[2:] != self.shape[:2]:
            raise ValueError(f"routes of {list(routes.shape[2:])} (MoE layers, top_k) for a model of "
                             f"{None if self.shape is None else list(self.shape[:2])}")
        b, s = routes.shape[:2]
        full = torch.full((*padded, *routes.shape[2:]), -1, dtype=torch.int32, device=routes.device)
        full[:b, :s] = routes
        return full.permute(2, 1, 0, 3).reshape(routes.shape[2], padded[0] * padded[1], routes.shape[3])

    def forget(self) -> None:
        """Drops what the forwards so far saw (no collective)."""
        self._rows.clear()
        for replay in self.replays:
            replay.seen.clear()

    def take(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([2] long: replayed (token, layer) pairs, pairs whose live top-k differs; [2, rows] uint8: per row of
        the replaying forwards since the last take, concatenated, whether any of this rank's layers replayed /
        differs there), on ``device``; then forgets them."""
        passes = sorted(self._rows)
        flags = torch.zeros(2, sum(self._rows[p] for p in passes), dtype=torch.bool, device=device)
        pairs = torch.zeros(2, dtype=torch.long, device=device)
        start = 0
        for p in passes:
            n = self._rows[p]
            for replay in self.replays:
                seen = replay.seen.get(p)
                if seen is not None and seen.replayed.numel() == n:
                    both = torch.stack([seen.replayed, seen.differs]).to(device)
                    flags[:, start:start + n] |= both
                    pairs += both.sum(1)
            start += n
        self.forget()
        return pairs, flags.to(torch.uint8)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[dict[int, list[torch.Tensor]]]:
        """{MoE index: the live top-k [rows, k] of each router call} for the forwards inside."""
        captured: dict[int, list[torch.Tensor]] = {}
        for replay in self.replays:
            replay.capture = captured.setdefault(replay.moe_index, [])
        try:
            yield captured
        finally:
            for replay in self.replays:
                replay.capture = None


def moe_index_of(layout: Qwen3Layout) -> dict[int, int]:
    """Global layer index -> its index among the model's MoE layers (the routes' layer axis)."""
    return {layer: i for i, layer in enumerate(j for j, moe in enumerate(layout.moe_layers) if moe)}


def install(model: GPTModel, layout: Qwen3Layout) -> RouterReplays:
    """Gives every TopKRouter of this rank's ``model`` a `RecordedTopk` (module docstring); routes stay live
    until `RouterReplays.set` hands a forward its routes."""
    from megatron.core.transformer.moe.router import TopKRouter

    index = moe_index_of(layout)
    replays = []
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if not isinstance(router, TopKRouter):
            continue
        if router.routing_type == "sinkhorn" or router.config.moe_router_fusion:
            raise ValueError("routing replay needs megatron's unfused top-k router (the hook it calls)")
        replay = RecordedTopk(index[layer.layer_number - 1])
        router.router_replay = replay
        replays.append(replay)
    shape = (len(index), layout.moe_topk, layout.num_experts) if index else None
    return RouterReplays(replays, shape)


def routing_counts(replays: RouterReplays, records: Sequence[TrajectoryRecord], device: torch.device,
                   pp_group: dist.ProcessGroup | None, all_reduce_ints: Callable[[list[int]], list[int]]) -> list[int]:
    """[replayed pairs, differing pairs, replayed tokens, tokens differing in any layer, routed policy tokens,
    policy tokens, records with routes] of the forwards since the last call and this rank's ``records``, summed
    over the whole model: per token over the pipeline's stages (``pp_group``, None: one stage), then over the
    data-parallel ranks (``all_reduce_ints``)."""
    pairs, flags = replays.take(device)
    if pp_group is not None:  # each stage holds its own layers: pairs add up, a token differs if any stage's does
        dist.all_reduce(pairs, group=pp_group)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pp_group)
    local = torch.cat([pairs, flags.sum(1)]).tolist()
    return all_reduce_ints([*local, *record_counts(records)])


@torch.no_grad()
def live_routes(model: GPTModel, replays: RouterReplays, vocab_size: int, records: Sequence[TrajectoryRecord],
                device: torch.device) -> list[RoutedExperts]:
    """The experts this model's routers choose for each record's positions (prompt + completion but the last),
    one forward per record: what the engine routes without replay (tests and benchmarks hold recorded routes
    against it). Needs every MoE layer on this rank (pipeline_parallel_size 1)."""
    if replays.shape is None or len(replays.replays) != replays.shape[0]:
        raise ValueError("live routes need every MoE router on this rank (a MoE model, no pipeline stages)")
    layers, _, experts = replays.shape
    out = []
    for r in records:
        ids = list(r.prompt_token_ids) + list(r.completion_token_ids)[:-1]
        replays.set(None, (1, len(ids)))
        with replays.capturing() as captured:
            compute_logits(model, torch.tensor([ids], device=device), vocab_size)
        per_layer = [captured[i][0] for i in range(layers)]  # [positions, k]: one row, sequence-major = positions
        out.append(RoutedExperts(torch.stack(per_layer, dim=1).to(torch.int16).numpy(), experts))
    return out
