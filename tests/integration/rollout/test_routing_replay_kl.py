"""Routing replay (R3) against the mismatch it is for: a bfloat16 vLLM rollout and a float32 trainer on a MoE
whose routers are as flat as a real 128-expert model's (Qwen3-30B-A3B's top-8 of 128 on the tiny widths, random
init). The rollout records its routes; the trainer's logprobs of the rollout's own tokens, with and without
replaying them, are held against the rollout's: replay must at least halve KL(rollout || trainer)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorarl.assets.models import build_random_model
from lorarl.contract.routes import RoutedExperts
from lorarl.contract.training import CorrectionSpec
from lorarl.rollout.config import RolloutSettings
from lorarl.trainer.engines.api import TrainingSpec, TrajectoryRecord
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.correction import correct
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import RolloutHarness

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [(5 + i, 17 + 3 * i, 40 + i, 9, 77 - i, 12 + 2 * i) for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("a3b-router")
    build_random_model("qwen3-moe-tiny-a3b-router", out, seed=3, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def rollout(model_dir: Path) -> Iterator[RolloutHarness]:
    harness = RolloutHarness(RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="bfloat16",
                                             max_model_len=256, kv_cache_gib=0.25, record_routes=True)).start()
    yield harness
    harness.close()


def kl(trainer: list[list[float]], records: list[TrajectoryRecord]) -> dict[str, float]:
    rows = max(len(r.completion_token_ids) for r in records)
    train = torch.zeros(len(records), rows)
    sampler = torch.zeros(len(records), rows)
    mask = torch.zeros(len(records), rows)
    for b, (lp, r) in enumerate(zip(trainer, records, strict=True)):
        n = len(r.completion_token_ids)
        train[b, :n], sampler[b, :n], mask[b, :n] = torch.tensor(lp), torch.tensor(r.behavior_logprobs), 1.0
    return correct(train, sampler, mask, CorrectionSpec()).metrics


def test_replaying_the_rollouts_routes_halves_the_mismatch(rollout: RolloutHarness, model_dir: Path) -> None:
    response = rollout.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=p) for p in PROMPTS],
        sampling=common_pb2.SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=11, logprobs=0)), timeout=120)
    records = []
    for result in response.results:
        for c in result.completions:
            records.append(TrajectoryRecord(list(result.prompt_token_ids), list(c.token_ids), list(c.logprobs),
                                            [0] * len(c.token_ids), 0.0,
                                            routes=RoutedExperts.from_proto(c.routed_experts)))
    assert all(r.routes is not None and r.routes.recorded_fraction == 1.0 for r in records)
    engine = TorchEngine.create(TrainingSpec(base_model_path=str(model_dir)))
    live = engine.compute_logprobs([TrajectoryRecord(r.prompt_token_ids, r.completion_token_ids, r.behavior_logprobs,
                                                     r.token_versions, 0.0) for r in records])
    replayed = engine.compute_logprobs(records)
    step = engine.forward_backward(records)  # its own count of what the live routers would have picked
    without, with_r3 = kl(live, records), kl(replayed, records)
    print(f"KL k3 without R3 {without['rollout_kl_k3']:.3e}, with {with_r3['rollout_kl_k3']:.3e}; tokens routed "
          f"otherwise in some layer: {step['routing_token_disagreement']:.2f}")
    assert with_r3["rollout_kl_k3"] <= 0.5 * without["rollout_kl_k3"], (without, with_r3)
    # bf16 and fp32 part on a real share of a flat router's choices, as on Qwen3-30B-A3B (~10% of routers)
    assert step["routing_replayed_fraction"] == 1.0 and 0.01 < step["routing_disagreement"] < 0.5
    assert step["rollout_kl_k3"] == pytest.approx(with_r3["rollout_kl_k3"], rel=0.05)
