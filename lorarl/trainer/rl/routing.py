"""Routing replay (R3), engine-neutral: which experts a replaying router uses, and the ``routing_*`` metrics.

The rule, written once for both engines (the torch engine's router forward, lorarl.trainer.engines.torch.
routing_replay; megatron-core's router hook, lorarl.trainer.engines.megatron.routing_replay): a row with a recorded
route (its first expert >= 0) takes the recorded experts, a row without one (-1: padding, not recorded) keeps
the live top-k; a replayed row "differs" where the live top-k set is not the recorded one. The engines then
gather their weights by their own scoring (the live softmax, renormalised as ``norm_topk_prob`` says), so
gradients still reach the router.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorarl.trainer.rl.trajectory import TrajectoryRecord


def select_experts(live: torch.Tensor, recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices, replayed, differs) for one router call: ``live`` [rows, k] the router's own top-k, ``recorded``
    [rows, k] the routes to replay (-1 rows: none). ``replayed`` [rows] marks the rows that take the recorded
    experts, ``differs`` [rows] those among them whose live set is another."""
    if recorded.shape != live.shape:
        raise RuntimeError(f"routing replay of {list(recorded.shape)} for a router call of {list(live.shape)}")
    recorded = recorded.to(live.device, torch.long)
    replayed = recorded[:, 0] >= 0
    indices = torch.where(replayed.unsqueeze(1), recorded, live)
    differs = (live.sort(-1).values != indices.sort(-1).values).any(-1) & replayed
    return indices, replayed, differs


def replayed_counts(records: Sequence[TrajectoryRecord]) -> tuple[int, int]:
    """(policy tokens whose predicting position (the one before each) has a recorded route, policy tokens)."""
    routed = total = 0
    for r in records:
        prompt = len(r.prompt_token_ids)
        for j, trained in enumerate(r.trained()):
            if not trained:
                continue
            total += 1
            p = prompt - 1 + j
            routed += r.routes is not None and p < r.routes.positions and bool(r.routes.ids[p, :, 0].min() >= 0)
    return routed, total


def record_counts(records: Sequence[TrajectoryRecord]) -> list[int]:
    """[policy tokens with a recorded route, policy tokens, records with routes] of ``records``: the batch's half
    of the counts `metrics_from_counts` takes (ranks holding shards sum them first)."""
    return [*replayed_counts(records), sum(r.routes is not None for r in records)]


def metrics_from_counts(counts: Sequence[int]) -> dict[str, float]:
    """Every ``routing_*`` metric from an engine's router counts (replayed (token, layer) pairs, those whose live
    top-k set differs, replayed tokens, those where any layer's differs) + `record_counts` (multi-rank engines sum
    them over their ranks first): ``routing_replayed_tokens``, ``routing_disagreement``,
    ``routing_token_disagreement`` when anything was replayed, and ``routing_replayed_fraction`` when any record
    carried routes."""
    pairs, differing, tokens, any_differs, routed, total, with_routes = counts
    stats = {} if not pairs else {"routing_replayed_tokens": float(tokens), "routing_disagreement": differing / pairs,
                                  "routing_token_disagreement": any_differs / max(tokens, 1)}
    if with_routes:
        stats["routing_replayed_fraction"] = routed / total if total else 0.0
    return stats
