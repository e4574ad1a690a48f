"""Multi-turn trajectories: the loss mask (lorarl.v1.Trajectory.loss_mask) trains the policy's tokens
and only conditions on the tools' and environment's. The engine's step (prefix sharing, completion
packing, micro-batches, activation checkpointing) is held to a plain per-record implementation, and
whatever masked tokens carry (absurd logprobs, versions, per-turn rewards) changes no gradient."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from lorarl.trainer.engines.api import LimitsSpec, MemorySpec, TrajectoryRecord
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.batching import group_index
from lorarl.trainer.rl.lora import lora_parameters
from lorarl.trainer.rl.losses import LossSpec, group_advantages
from lorarl.trainer.service.convert import trajectory_record
from lorarl.trainer.service.validation import InvalidTrajectory, validate_trajectory
from lorarl.v1 import common_pb2
from tests.unit.trainer.engine_utils import make_spec
from tests.unit.trainer.tiny import randomize_adapters


def episodes(vocab: int, seed: int = 0, groups: int = 2, group_size: int = 3) -> list[TrajectoryRecord]:
    """Groups of multi-turn episodes: policy turns separated by tool/environment turns of varied length."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 6))]
        for _ in range(group_size):
            ids, mask = [], []
            for turn in range(rng.randint(2, 3)):
                if turn:
                    env = rng.randint(1, 5)
                    ids += [rng.randrange(1, vocab) for _ in range(env)]
                    mask += [False] * env
                policy = rng.randint(1, 4)
                ids += [rng.randrange(1, vocab) for _ in range(policy)]
                mask += [True] * policy
            out.append(TrajectoryRecord(prompt, ids, [0.0] * len(ids), [0] * len(ids), float(rng.randint(0, 3)),
                                        f"g{g}", loss_mask=mask))
    return out


def plain_logprobs(model: torch.nn.Module, record: TrajectoryRecord) -> torch.Tensor:
    """One record through the whole model, every completion token's logprob (no batching, no sharing)."""
    ids = torch.tensor([record.prompt_token_ids + record.completion_token_ids])
    logits = model(input_ids=ids).logits[0].float()
    P, C = len(record.prompt_token_ids), len(record.completion_token_ids)
    return logits[P - 1: P + C - 1].log_softmax(-1).gather(1, torch.tensor(record.completion_token_ids)[:, None])[:, 0]


def plain_gradients(engine: TorchEngine, records: list[TrajectoryRecord], loss: str) -> list[torch.Tensor]:
    """The on-policy clipped loss written out per record over the masked tokens only."""
    rewards = torch.tensor([r.reward for r in records])
    advantages = group_advantages(rewards, group_index(records), loss)
    engine.model.train()
    for p in lora_parameters(engine.model):
        p.grad = None
    per_record, trained = [], 0
    for record, advantage in zip(records, advantages, strict=True):
        logp = plain_logprobs(engine.model, record)
        mask = torch.tensor(record.trained())
        terms = -advantage * (logp - logp.detach()).exp()[mask]  # ratio 1: behaviour == policy
        per_record.append(terms)
        trained += int(mask.sum())
    if loss == "grpo":  # seq-mean-token-mean
        total = torch.stack([t.mean() for t in per_record]).mean()
    else:  # token-mean
        total = torch.cat(per_record).sum() / trained
    total.backward()
    engine.model.eval()
    return [p.grad.clone() for p in lora_parameters(engine.model)]


def on_policy(engine: TorchEngine, records: list[TrajectoryRecord], masked_logprob: float = -1e30,
              masked_version: int = 7) -> list[TrajectoryRecord]:
    """Behaviour logprobs = the policy's own on trained tokens; masked tokens get absurd values."""
    out = []
    with torch.no_grad():
        for r in records:
            logp = plain_logprobs(engine.model, r).tolist()
            out.append(TrajectoryRecord(
                r.prompt_token_ids, r.completion_token_ids,
                [lp if m else masked_logprob for lp, m in zip(logp, r.trained(), strict=True)],
                [0 if m else masked_version for m in r.trained()], r.reward, r.group_id, loss_mask=r.loss_mask,
                turn_rewards=[1e30] * r.policy_turns()))
    return out


def engine_gradients(engine: TorchEngine, records: list[TrajectoryRecord], loss: str) -> list[torch.Tensor]:
    engine.optimizer.zero_grad(set_to_none=True)
    engine._pending_grads = False
    metrics = engine.forward_backward(records, LossSpec(type=loss))
    assert metrics["tokens"] == sum(r.trained_tokens for r in records)
    assert all(math.isfinite(v) for v in metrics.values())
    return [p.grad.clone() for p in lora_parameters(engine.model)]


@pytest.mark.parametrize(("kind", "loss", "micro_batch_tokens", "checkpointing"),
                         [("dense", "grpo", 0, "off"), ("dense", "dapo", 24, "on"), ("moe", "grpo", 30, "off")])
def test_the_step_trains_only_the_policy_tokens_as_a_plain_loss_does(kind: str, loss: str, micro_batch_tokens: int,
                                                                     checkpointing: str, dense_dir: Path,
                                                                     moe_dir: Path) -> None:
    path = dense_dir if kind == "dense" else moe_dir
    engine = TorchEngine(make_spec(path, device="cpu", micro_batch_tokens=micro_batch_tokens,
                                   memory=MemorySpec(activation_checkpointing=checkpointing)))
    randomize_adapters(engine.model, seed=3, std=0.05)
    records = on_policy(engine, episodes(engine.vocab_size))
    assert any(not all(r.trained()) for r in records)
    want = plain_gradients(engine, records, loss)
    got = engine_gradients(engine, records, loss)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert sum(float(w.norm()) for w in want) > 0


def test_what_masked_tokens_carry_changes_nothing(dense_dir: Path) -> None:
    engine = TorchEngine(make_spec(dense_dir, device="cpu", loss=LossSpec(max_staleness=0)))
    randomize_adapters(engine.model, seed=5, std=0.05)
    records = episodes(engine.vocab_size, seed=1)
    calm = on_policy(engine, records, masked_logprob=0.0, masked_version=0)
    wild = on_policy(engine, records, masked_logprob=-1e30, masked_version=10**6)
    for loss in ("grpo", "dapo", "gspo"):
        a, b = engine_gradients(engine, calm, loss), engine_gradients(engine, wild, loss)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    # The same episode with every token the policy's trains on the tool tokens too: the mask does something.
    unmasked = [TrajectoryRecord(r.prompt_token_ids, r.completion_token_ids, [0.0] * len(r.completion_token_ids),
                                 [0] * len(r.completion_token_ids), r.reward, r.group_id) for r in calm]
    assert any(not torch.equal(x, y) for x, y in zip(engine_gradients(engine, calm, "dapo"),
                                                      engine_gradients(engine, unmasked, "dapo"), strict=True))


def test_a_single_turn_trajectory_is_unchanged_by_an_all_true_mask(dense_dir: Path) -> None:
    engine = TorchEngine(make_spec(dense_dir, device="cpu"))
    randomize_adapters(engine.model, seed=2, std=0.05)
    records = [TrajectoryRecord(r.prompt_token_ids, r.completion_token_ids, r.behavior_logprobs, r.token_versions,
                                r.reward, r.group_id) for r in episodes(engine.vocab_size, seed=4)]
    masked = [TrajectoryRecord(r.prompt_token_ids, r.completion_token_ids, r.behavior_logprobs, r.token_versions,
                               r.reward, r.group_id, loss_mask=[True] * len(r.completion_token_ids)) for r in records]
    for x, y in zip(engine_gradients(engine, records, "grpo"), engine_gradients(engine, masked, "grpo"), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_the_contract_carries_the_mask_and_the_trainer_checks_it() -> None:
    proto = common_pb2.Trajectory(prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5, 6],
                                  behavior_logprobs=[-0.5, float("nan"), 9.0, -0.25], token_versions=[0, 99, 99, 0],
                                  loss_mask=[True, False, False, True], turn_rewards=[0.5, 1.0], reward=1.0)
    record = trajectory_record(proto)
    assert record.loss_mask == [True, False, False, True] and record.trained_tokens == 2
    assert record.policy_turns() == 2 and record.turn_rewards == [0.5, 1.0]
    limits = LimitsSpec()
    validate_trajectory(record, vocab_size=10, current_version=0, limits=limits)  # masked entries are not read
    old = trajectory_record(common_pb2.Trajectory(prompt_token_ids=[1], completion_token_ids=[2],
                                                  behavior_logprobs=[-1.0], token_versions=[0]))
    assert old.loss_mask is None and old.trained_tokens == 1  # single turn, unchanged

    def refused(**changes: object) -> InvalidTrajectory:
        bad = trajectory_record(proto)
        for key, value in changes.items():
            setattr(bad, key, value)
        with pytest.raises(InvalidTrajectory) as info:
            validate_trajectory(bad, vocab_size=10, current_version=0, limits=limits)
        return info.value

    assert refused(loss_mask=[True, False]).field == "loss_mask"
    assert refused(loss_mask=[False] * 4).field == "loss_mask"
    assert refused(turn_rewards=[1.0]).field == "turn_rewards"
    assert refused(turn_rewards=[1.0, math.inf]).field == "turn_rewards"
    assert refused(behavior_logprobs=[math.nan, -1.0, -1.0, -1.0]).field == "behavior_logprobs"  # a policy token
