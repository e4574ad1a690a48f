"""Routing replay (R3) in the torch engine: recorded experts are what the MoE routers use, in every forward
layout the engine has (plain, shared prompt padded or packed, activation checkpointing), with the weights
gathered from the live router so gradients still reach it; and what the trainer accepts as routes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from lorarl.contract.routes import NOT_RECORDED, RoutedExperts
from lorarl.contract.training import MemorySpec
from lorarl.trainer.engines.api import LimitsSpec, TrajectoryRecord
from lorarl.trainer.engines.torch import routing_replay
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.ranks.commands import record_from_json, record_to_json
from lorarl.trainer.rl.losses import LossSpec
from lorarl.trainer.service.validation import InvalidTrajectory, RouteRule, validate_trajectory
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch


def engine_on(moe_dir: Path, **kwargs: object) -> TorchEngine:
    return TorchEngine.create(make_spec(moe_dir, seed=3, **kwargs))


def with_routes(records: list[TrajectoryRecord], routes: list[RoutedExperts]) -> list[TrajectoryRecord]:
    return [replace(r, routes=x) for r, x in zip(records, routes, strict=True)]


def other_experts(routes: RoutedExperts, seed: int = 0) -> RoutedExperts:
    """Valid routes that differ from ``routes`` at most positions."""
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(routes.num_experts, routes.top_k, replace=False) for _ in range(routes.layers)]
                    for _ in range(routes.positions)]).astype(np.int16)
    return RoutedExperts(ids, routes.num_experts)


@pytest.mark.parametrize("layout", ["plain", "shared-padded", "shared-packed", "checkpointed"])
def test_replaying_the_trainers_own_routes_changes_nothing(moe_dir: Path, layout: str) -> None:
    engine = engine_on(moe_dir, memory=MemorySpec(activation_checkpointing="on" if layout == "checkpointed" else "off"))
    engine.share_prompts = layout != "plain"
    engine.pack_completions = layout == "shared-packed"
    batch = synthetic_batch(4, groups=2, group_size=3)
    own = with_routes(batch, routing_replay.live_routes(engine.model, batch))
    plain = engine.compute_logprobs(batch)
    replayed = engine.compute_logprobs(own)
    for a, b in zip(plain, replayed, strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    metrics = engine.forward_backward(own)
    assert metrics["routing_replayed_fraction"] == 1.0
    assert metrics["routing_disagreement"] == 0.0 and metrics["routing_token_disagreement"] == 0.0


def test_each_forward_counts_once_however_often_its_layers_run(moe_dir: Path) -> None:
    """The routing figures count every replaying forward of a step (policy and reference) once each, with a
    layer recomputed under activation checkpointing counted once: the policy's routes tensor is freed before
    the reference forward builds its own, so a count keyed by the tensor's address could merge the two."""
    batch = synthetic_batch(4, groups=2, group_size=3)
    counts = {}
    for checkpointing in ("off", "on"):
        engine = engine_on(moe_dir, memory=MemorySpec(activation_checkpointing=checkpointing),
                           loss=LossSpec(type="grpo", kl_coef=0.05))
        engine.share_prompts = False
        own = with_routes(batch, routing_replay.live_routes(engine.model, batch))
        counts[checkpointing] = [engine.forward_backward(own)["routing_replayed_tokens"] for _ in range(3)]
    positions = sum(r.num_tokens - 1 for r in batch)
    assert counts["off"] == counts["on"] == [2 * positions] * 3


@pytest.mark.parametrize("share_prompts", [False, True])
def test_recorded_experts_are_the_ones_used_and_unrecorded_positions_route_live(moe_dir: Path,
                                                                                share_prompts: bool) -> None:
    engine = engine_on(moe_dir)
    engine.share_prompts = share_prompts
    batch = synthetic_batch(5, groups=2, group_size=2)
    live = routing_replay.live_routes(engine.model, batch)
    forced = same_prompt_routes(batch, [other_experts(r, seed=i) for i, r in enumerate(live)])
    plain = engine.compute_logprobs(batch)
    replayed = engine.compute_logprobs(with_routes(batch, forced))
    assert any(abs(a - b) > 1e-3 for p, q in zip(plain, replayed, strict=True) for a, b in zip(p, q, strict=True))
    # the same forced experts, written into the model by hand: a reference that knows nothing of replay
    reference = hand_routed_logprobs(engine, batch, forced)
    for a, b in zip(reference, replayed, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    # nothing recorded anywhere: live routing, exactly the plain numbers
    blank = [RoutedExperts.empty(r.positions, r.layers, r.top_k, r.num_experts) for r in live]
    for a, b in zip(plain, engine.compute_logprobs(with_routes(batch, blank)), strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    metrics = engine.forward_backward(with_routes(batch, forced))
    assert metrics["routing_token_disagreement"] > 0.5 and 0 < metrics["routing_disagreement"] <= 1


def same_prompt_routes(batch: list[TrajectoryRecord], routes: list[RoutedExperts]) -> list[RoutedExperts]:
    """``routes`` with every row of a group given its first row's prompt routes, as a rollout records them (one
    prompt, one set of weights: the shared-prompt forward runs a group's prompt once, with its first row's)."""
    first: dict[str, RoutedExperts] = {}
    out = []
    for record, r in zip(batch, routes, strict=True):
        lead = first.setdefault(record.group_id, r)
        ids = r.ids.copy()
        n = len(record.prompt_token_ids)
        ids[:n] = lead.ids[:n]
        out.append(RoutedExperts(ids, r.num_experts))
    return out


def hand_routed_logprobs(engine: TorchEngine, records: list[TrajectoryRecord], routes: list[RoutedExperts]
                         ) -> list[list[float]]:
    """Each record alone through the HF model, each router's top-k indices replaced by ``routes`` and its weights
    recomputed from the live softmax (the R3 rule), by wrapping torch.topk for the router calls."""
    found = routing_replay.moe_layers(engine.model)
    out = []
    original = torch.topk
    for record, r in zip(records, routes, strict=True):
        ids = list(record.prompt_token_ids) + list(record.completion_token_ids)
        with torch.no_grad():
            for _, router in found:
                router.forward = type(router).forward.__get__(router)  # the class's own router
            torch.topk = forcing_topk(r, iter(range(len(found))), original)
            try:
                logits = engine.model(input_ids=torch.tensor([ids])).logits[0].float()
            finally:
                torch.topk = original
                routing_replay_reinstall(engine)
        logp = torch.log_softmax(logits, -1)
        prompt = len(record.prompt_token_ids)
        out.append([float(logp[prompt - 1 + j, t]) for j, t in enumerate(record.completion_token_ids)])
    return out


def forcing_topk(routes: RoutedExperts, layers: object, original: object) -> object:
    """torch.topk for one forward's router calls in layer order: the recorded experts, weights gathered."""

    def topk(x: torch.Tensor, k: int, dim: int = -1, **kwargs: object) -> object:
        layer = next(layers)  # type: ignore[call-overload]
        idx = torch.from_numpy(routes.ids[:, layer].astype(np.int64))
        idx = torch.cat([idx, original(x[len(idx):], k, dim=dim).indices])  # type: ignore[operator]  # last token
        return torch.return_types.topk((x.gather(-1, idx), idx))

    return topk


def routing_replay_reinstall(engine: TorchEngine) -> None:
    import types

    for _, router in routing_replay.moe_layers(engine.model):
        router.forward = types.MethodType(routing_replay._replaying_router_forward, router)


def test_gradients_reach_the_router_through_the_replayed_experts_weights(moe_dir: Path) -> None:
    engine = engine_on(moe_dir)
    batch = synthetic_batch(6, groups=1, group_size=2)
    routes = routing_replay.live_routes(engine.model, batch)
    router = routing_replay.moe_layers(engine.model)[0][1]
    router.weight.requires_grad_(True)
    try:
        from lorarl.trainer.rl.batching import pack

        packed = pack(with_routes(batch, [other_experts(r) for r in routes]))
        logp, _ = engine.completion_logprobs(packed)
        (logp * packed.mask).sum().backward()
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0
    finally:
        router.weight.requires_grad_(False)
        router.weight.grad = None


# ---------------------------------------------------------------- what the trainer accepts


def one_record(routes: RoutedExperts | None = None, problem: tuple[str, str] | None = None) -> TrajectoryRecord:
    return TrajectoryRecord([1, 2, 3], [4, 5], [-1.0, -1.0], [0, 0], 1.0, "g", routes=routes, routes_problem=problem)


def test_routes_are_checked_against_the_job_that_replays_them() -> None:
    rule = RouteRule((3, 2, 8))
    fine = one_record(RoutedExperts(np.tile(np.array([0, 1], np.int16), (4, 3, 1)), 8))
    validate_trajectory(fine, 16, 0, LimitsSpec(), routes=rule)
    short = one_record(fine.routes.truncated(3))
    for rec, field in [(short, "routed_experts.positions"), (one_record(problem=("data", "too short")),
                                                             "routed_experts.data")]:
        with pytest.raises(InvalidTrajectory) as err:
            validate_trajectory(rec, 16, 0, LimitsSpec(), routes=rule)
        assert err.value.field == field
    with pytest.raises(InvalidTrajectory, match="cannot replay routes"):  # a dense job
        validate_trajectory(one_record(fine.routes), 16, 0, LimitsSpec(), routes=RouteRule(None))
    ignored = one_record(fine.routes)
    validate_trajectory(ignored, 16, 0, LimitsSpec(), routes=RouteRule((3, 2, 8), ignore=True))
    assert ignored.routes is None  # routing_replay 'off': dropped, as the job asked


def test_routes_cross_the_rank_commands_intact() -> None:
    routes = RoutedExperts(np.tile(np.array([2, 5], np.int16), (4, 3, 1)), 8)
    routes.ids[0] = NOT_RECORDED
    back = record_from_json(record_to_json(one_record(routes)), "batch[0]")
    assert back.routes is not None
    np.testing.assert_array_equal(back.routes.ids, routes.ids)
