"""Routing replay (R3) in the Megatron engine on the shipped tiny Qwen3-MoE: recorded experts are what its
routers use (the torch engine's logprobs for the same routes and adapter, -1 rows routing live), in the
plain, reference, checkpointed and multi-rank (TP, EP, PP) forwards, with the torch engine's routing_* figures;
and a trainer job on it takes routes."""

from __future__ import annotations

import asyncio
import gc
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from lorarl.assets import MOE_MODEL_DIR
from lorarl.contract.routes import NOT_RECORDED, RoutedExperts
from lorarl.trainer.engines.api import MegatronSpec, MemorySpec, TrainingSpec, TrajectoryRecord
from lorarl.trainer.engines.megatron.engine import MegatronEngine
from lorarl.trainer.engines.megatron.routing_replay import live_routes
from lorarl.trainer.engines.recompute import disable_activation_checkpointing, enable_activation_checkpointing
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.batching import micro_batches
from lorarl.trainer.rl.lora import LoraConfig, load_peft_state_dict
from lorarl.trainer.rl.losses import LossSpec
from lorarl.trainer.service.jobs import JobManager
from tests.support.workers import run_workers
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.fp64 import max_diff

VOCAB = 250  # token ids below the tiny model's vocabulary (264)
TOLERANCE = 1e-4  # the megatron/torch parity tests' bound on logprobs
ROUTING = ("routing_replayed_tokens", "routing_disagreement", "routing_token_disagreement",
           "routing_replayed_fraction")
#: (tp, pp, ep) on two ranks: tensor, expert and pipeline parallel
LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}


def spec(sizes: tuple[int, int, int] = (1, 1, 1), checkpointing: str = "off") -> TrainingSpec:
    tp, pp, ep = sizes
    return make_spec(MOE_MODEL_DIR, engine="megatron", lora=LoraConfig(rank=4, alpha=8),
                     loss=LossSpec(type="grpo", kl_coef=0.05),
                     memory=MemorySpec(activation_checkpointing=checkpointing),
                     megatron=MegatronSpec(tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=ep))


def start(engine: MegatronEngine) -> None:
    """The same non-zero full adapters whatever the layout."""
    g = torch.Generator().manual_seed(5)
    shapes = engine._checkpoint_shapes()
    engine.lora.load_full({n: torch.randn(shapes[n], generator=g) * 0.05 for n in sorted(shapes)})


def discard_gradients(engine: MegatronEngine) -> None:
    engine.optimizer.zero_grad(set_to_none=True)
    engine._pending_grads = False


def arbitrary_routes(record: TrajectoryRecord, seed: int, layers: int = 4, top_k: int = 2, experts: int = 8
                     ) -> RoutedExperts:
    """Random valid routes (a live top-2 of 8 is the same set 1 time in 28), not recorded (-1) at every fourth
    position and at layer 1 of every fifth: those rows route live."""
    rng = np.random.default_rng(seed)
    n = record.num_tokens - 1
    ids = np.stack([[rng.choice(experts, top_k, replace=False) for _ in range(layers)] for _ in range(n)])
    ids = ids.astype(np.int16)
    ids[1::4] = NOT_RECORDED
    ids[2::5, 1] = NOT_RECORDED
    return RoutedExperts(ids, experts)


def routed_batch(seed: int = 4) -> list[TrajectoryRecord]:
    """Two groups of two with arbitrary routes, each group's prompt routed alike (one prompt, one rollout
    forward: the torch engine's shared-prompt forward reads the group's first row's)."""
    batch = synthetic_batch(seed, groups=2, group_size=2, vocab=VOCAB)
    out, first = [], {}
    for i, record in enumerate(batch):
        routes = arbitrary_routes(record, seed * 100 + i)
        lead = first.setdefault(record.group_id, routes)
        n = len(record.prompt_token_ids)
        routes.ids[:n] = lead.ids[:n]
        out.append(replace(record, routes=routes))
    return out


def without_routes(batch: list[TrajectoryRecord]) -> list[TrajectoryRecord]:
    return [replace(r, routes=None) for r in batch]


@pytest.fixture(scope="module")
def engines() -> tuple[MegatronEngine, TorchEngine]:
    """A megatron engine and a torch engine holding the same adapter (the parity tests' way)."""
    megatron = MegatronEngine(spec())
    start(megatron)
    torch_engine = TorchEngine(make_spec(MOE_MODEL_DIR, lora=LoraConfig(rank=4, alpha=8),
                                         loss=LossSpec(type="grpo", kl_coef=0.05)))
    load_peft_state_dict(torch_engine.model, dict(megatron.iter_adapter_tensors()))
    return megatron, torch_engine


def test_replayed_routes_give_the_torch_engines_logprobs_and_figures(engines: tuple[MegatronEngine, TorchEngine]
                                                                     ) -> None:
    megatron, torch_engine = engines
    assert megatron.route_shape == torch_engine.route_shape == (4, 2, 8)
    routed = routed_batch()
    live = megatron.compute_logprobs(without_routes(routed))
    for reference in (False, True):  # the policy and the adapters-off reference both replay
        replayed = megatron.compute_logprobs(routed, reference=reference)
        assert max_diff(replayed, torch_engine.compute_logprobs(routed, reference=reference)) <= TOLERANCE
    assert max_diff(megatron.compute_logprobs(routed), live) > 1e-2  # the routes matter: the parity can fail
    torch_engine.share_prompts = False  # its plain forward: rows counted as megatron's, not a group's prompt once
    try:
        mine, theirs = megatron.forward_backward(routed), torch_engine.forward_backward(routed)
    finally:
        torch_engine.share_prompts = True
        discard_gradients(megatron)
        torch_engine.optimizer.zero_grad(set_to_none=True)
        torch_engine._pending_grads = False
    assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    for key in ROUTING:
        assert mine[key] == pytest.approx(theirs[key], abs=1e-9), key
    assert mine["routing_token_disagreement"] > 0.5 and 0 < mine["routing_replayed_fraction"] < 1


def test_routes_follow_their_records_into_micro_batches(engines: tuple[MegatronEngine, TorchEngine]) -> None:
    """Split into micro-batches (each padded to its own length), every record still replays its own routes:
    the step's loss and routing figures are the single micro-batch's."""
    megatron = engines[0]
    routed = routed_batch()
    assert len(micro_batches([r.num_tokens for r in routed], 12)) >= 3
    try:
        whole = megatron.forward_backward(routed)
        discard_gradients(megatron)
        megatron.rl.micro_batch_tokens = 12
        split = megatron.forward_backward(routed)
    finally:
        megatron.rl.micro_batch_tokens = 0
        discard_gradients(megatron)
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-5)
    for key in ROUTING:
        assert split[key] == pytest.approx(whole[key], abs=1e-9), key
    assert all(replay.target_topk_idx is None for replay in megatron.replay.replays)  # not held between steps


def test_the_engines_own_routes_change_nothing_and_unrecorded_rows_route_live(
        engines: tuple[MegatronEngine, TorchEngine]) -> None:
    megatron = engines[0]
    batch = without_routes(routed_batch(seed=7))
    own = live_routes(megatron.model, megatron.replay, megatron.vocab_size, batch, megatron.device)
    blank = [RoutedExperts.empty(r.positions, r.layers, r.top_k, r.num_experts) for r in own]
    plain = megatron.compute_logprobs(batch)
    for routes in (own, blank):
        assert max_diff(plain, megatron.compute_logprobs(
            [replace(r, routes=x) for r, x in zip(batch, routes, strict=True)])) <= 1e-6
    no_reference = LossSpec(type="grpo")  # the reference (adapters off) routes otherwise: its hidden states differ
    metrics = megatron.forward_backward([replace(r, routes=x) for r, x in zip(batch, own, strict=True)], no_reference)
    discard_gradients(megatron)
    assert metrics["routing_replayed_fraction"] == 1.0 and metrics["routing_replayed_tokens"] > 0
    assert metrics["routing_disagreement"] == 0.0 and metrics["routing_token_disagreement"] == 0.0
    forced = megatron.forward_backward(routed_batch(seed=7))
    discard_gradients(megatron)
    assert 0 < forced["routing_disagreement"] <= 1 and forced["routing_token_disagreement"] > 0.5


def gradients(engine: MegatronEngine, batch: list[TrajectoryRecord]) -> dict[str, torch.Tensor]:
    metrics = engine.forward_backward(batch)
    grads = {n: p.grad.clone() for n, p in engine.named_trainable_parameters().items() if p.grad is not None}
    discard_gradients(engine)
    return {**grads, "_figures": torch.tensor([metrics.get(k, 0.0) for k in ROUTING])}


def test_a_recomputed_layer_replays_the_same_routes(engines: tuple[MegatronEngine, TorchEngine]) -> None:
    megatron = engines[0]
    routed = routed_batch(seed=9)
    plain = gradients(megatron, routed)
    enable_activation_checkpointing(megatron.model)
    try:
        recomputed = gradients(megatron, routed)
    finally:
        disable_activation_checkpointing(megatron.model)
    assert plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=0, atol=1e-6, msg=name)
    live = gradients(megatron, without_routes(routed))
    assert max((live[n] - plain[n]).abs().max().item() for n in plain if n in live and n != "_figures") > 1e-4


# ---------------------------------------------------------------- two ranks: TP, EP, PP


def layout_worker(rank: int, world_size: int, init_method: str, batch: list[TrajectoryRecord], out_dir: str
                  ) -> None:
    """Per layout: logprobs of the routed batch, then a step's loss, routing figures and gradient norm
    (activation checkpointing on: the recomputed layers replay too)."""
    from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel, teardown

    torch.set_num_threads(1)
    results = {}
    try:
        for name, (tp, pp, ep) in LAYOUTS.items():
            init_parallel(ParallelSettings(tp=tp, pp=pp, ep=ep), "cpu", rank=rank, world_size=world_size,
                          init_method=init_method, timeout_s=90)
            engine = MegatronEngine(spec((tp, pp, ep), checkpointing="on"))
            start(engine)
            results[name] = run(engine, batch)
            del engine
            gc.collect()
        if rank == 0:
            (Path(out_dir) / "layouts.json").write_text(json.dumps(results))
    finally:
        teardown()


def run(engine: MegatronEngine, batch: list[TrajectoryRecord]) -> dict[str, object]:
    logprobs = engine.compute_logprobs(batch)
    metrics = engine.forward_backward(batch)
    metrics.update(engine.optim_step())
    return {"logprobs": logprobs, "metrics": {k: metrics[k] for k in ("loss", "grad_norm", *ROUTING)}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("r3-layouts")
    run_workers(layout_worker, 2, (routed_batch(), str(out)), timeout_s=240)
    return json.loads((out / "layouts.json").read_text())


@pytest.fixture(scope="module")
def one_rank() -> dict[str, object]:
    """The same on one process (its own engine: the step moves the adapters)."""
    engine = MegatronEngine(spec())
    start(engine)
    return run(engine, routed_batch())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_ranks_replay_what_one_process_replays(name: str, two_ranks: dict[str, dict],
                                                   one_rank: dict[str, object]) -> None:
    got = two_ranks[name]
    assert max_diff(got["logprobs"], one_rank["logprobs"]) <= TOLERANCE
    for key, value in one_rank["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


# ---------------------------------------------------------------- the trainer takes routes for it


def test_a_megatron_job_takes_routes(engines: tuple[MegatronEngine, TorchEngine]) -> None:
    megatron = engines[0]
    manager = JobManager(engine_factory=lambda s: megatron)
    job_spec = replace(spec(), routing_replay="auto")
    try:
        job, _ = asyncio.run(manager.create("moe", job_spec))
        assert job.buffer.routes.shape == (4, 2, 8)
        assert manager.push("moe", routed_batch()) == [None] * 4
    finally:
        gc.unfreeze()


def test_routing_replay_on_is_accepted_for_a_megatron_job(engines: tuple[MegatronEngine, TorchEngine]) -> None:
    megatron = engines[0]
    manager = JobManager(engine_factory=lambda s: megatron)
    try:
        job, _ = asyncio.run(manager.create("moe-on", replace(spec(), routing_replay="on")))
        assert job.buffer.routes.shape == (4, 2, 8)
    finally:
        gc.unfreeze()
