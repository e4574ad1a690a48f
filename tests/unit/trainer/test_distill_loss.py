"""On-policy distillation's loss (#47 step 1): each token's advantage is the reverse KL to its teacher,
-(log pi_old - log pi_teacher), on the RL losses' own ratio, clipping, staleness and weights; checked against
hand computations, with what is refused, and through an engine's training pass (micro-batching included)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from lorarl.contract import staleness
from lorarl.contract.errors import SpecError
from lorarl.contract.training import LimitsSpec, LossSpec
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.batching import pack
from lorarl.trainer.rl.losses import LossInputs, policy_loss
from lorarl.trainer.rl.trajectory import TrajectoryRecord
from lorarl.trainer.service.validation import InvalidTrajectory, check_advantages_fit, validate_trajectory
from lorarl.v1 import trainer_pb2
from tests.unit.trainer.engine_utils import make_spec


def inputs(logp: list[float], behaviour: list[float], teacher: list[float], adv: float = 0.0,
           mask: list[float] | None = None) -> LossInputs:
    return LossInputs(logp=torch.tensor([logp], requires_grad=True),
                      mask=torch.tensor([mask or [1.0] * len(logp)]), advantages=torch.tensor([adv]),
                      behavior_logp=torch.tensor([behaviour]), teacher_logp=torch.tensor([teacher]))


def test_opd_is_the_reverse_kl_advantage_on_the_clipped_ratio_by_hand() -> None:
    # tokens: student (behaviour) -1 and -2, teacher -0.5 and -3 -> reverse KL 0.5 - ... per token:
    #   k = log pi_old - log pi_teacher = -1 - (-0.5) = -0.5  and  -2 - (-3) = 1.0;  advantage = -k = 0.5, -1.0
    # current logp -1 and -2 (ratio 1): loss = token-mean of -A * r = (-0.5 + 1.0) / 2
    x = inputs([-1.0, -2.0], [-1.0, -2.0], [-0.5, -3.0])
    loss, metrics = policy_loss(x, LossSpec(type="opd"))
    assert loss.item() == pytest.approx(0.25)
    assert metrics["distill_reverse_kl"] == pytest.approx(0.25)  # token mean of (-0.5, 1.0)
    loss.backward()
    # d/dlogp of -A * exp(logp - old) / 2 at ratio 1: -A / 2; the teacher is held fixed (no grad through it)
    assert x.logp.grad.tolist()[0] == pytest.approx([-0.25, 0.5])


def test_opd_clips_the_ratio_like_ppo() -> None:
    # ratio e^0.5 on a token the teacher prefers (A = +1): clipped at 1.2, so no gradient flows there
    x = inputs([-0.5], [-1.0], [0.0])
    loss, metrics = policy_loss(x, LossSpec(type="opd"))
    assert loss.item() == pytest.approx(-1.2)
    assert metrics["clip_fraction"] == 1.0
    loss.backward()
    assert x.logp.grad.tolist() == [[0.0]]


def test_the_reverse_kl_is_taken_at_the_proximal_policy_and_stale_tokens_are_masked() -> None:
    x = inputs([-1.0, -1.0], [-2.0, -1.0], [-1.5, -1.5])
    x.proximal_logp = torch.tensor([[-1.0, -1.0]])
    x.fresh = staleness.fresh(5, torch.tensor([[5, 1]]), 2).float()
    loss, metrics = policy_loss(x, LossSpec(type="opd", behavior_weight_cap=2.0, max_staleness=2))
    # token 0: k = -1 - (-1.5) = 0.5 -> A = -0.5; ratio 1 vs proximal; weight e^1 capped at 2 -> 0.5 * 2 = 1.0
    # token 1 is 4 versions stale: masked out of the mean
    assert loss.item() == pytest.approx(1.0)
    assert metrics["distill_reverse_kl"] == pytest.approx(0.5)


def test_rl_weight_and_distill_weight_mix_the_reward_with_the_teacher() -> None:
    x = inputs([-1.0, -1.0], [-1.0, -1.0], [-0.5, -1.5], adv=2.0)
    grpo, _ = policy_loss(x, LossSpec(type="grpo"))
    assert grpo.item() == pytest.approx(-2.0)  # no distillation unless asked
    mixed, _ = policy_loss(x, LossSpec(type="grpo", distill_weight=0.5, rl_weight=0.25))
    # per token A = 0.25 * 2 - 0.5 * k, k = (-0.5, 0.5): (0.75, 0.25); grpo's per-sequence mean of -A
    assert mixed.item() == pytest.approx(-(0.75 + 0.25) / 2)
    opd_with_reward, _ = policy_loss(x, LossSpec(type="opd", rl_weight=1.0))
    assert opd_with_reward.item() == pytest.approx(-((2.0 + 0.5) + (2.0 - 0.5)) / 2)


def test_what_distillation_refuses() -> None:
    with pytest.raises(SpecError, match="nothing would be learned"):
        LossSpec(type="opd", distill_weight=0.0)
    with pytest.raises(SpecError, match="distill_weight"):
        LossSpec(type="importance_sampling", distill_weight=1.0)
    with pytest.raises(SpecError, match="distill_weight"):
        LossSpec(type="opd", distill_weight=-1.0)
    with pytest.raises(ValueError, match="no teacher logprobs"):
        policy_loss(LossInputs(logp=torch.zeros(1, 1), mask=torch.ones(1, 1), advantages=torch.zeros(1),
                               behavior_logp=torch.zeros(1, 1)), LossSpec(type="opd"))
    back = LossSpec.from_proto(LossSpec(type="grpo", distill_weight=0.5, rl_weight=0.25).to_proto())
    assert (back.distill_scale, back.reward_scale) == (0.5, 0.25)
    assert LossSpec.from_proto(trainer_pb2.LossConfig(type=trainer_pb2.LOSS_TYPE_OPD)) == LossSpec(type="opd")


def record(seed: int, teacher: bool = True) -> TrajectoryRecord:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 97) for _ in range(rng.randint(1, 4))]
    completion = [rng.randrange(1, 97) for _ in range(rng.randint(3, 7))]
    return TrajectoryRecord(prompt, completion, [-rng.uniform(0.5, 3.0) for _ in completion], [0] * len(completion),
                            reward=float(seed % 2), group_id=f"g{seed // 2}",
                            teacher_logprobs=[-rng.uniform(0.1, 3.0) for _ in completion] if teacher else None)


def test_a_trajectory_carries_teacher_logprobs_exactly_when_the_loss_reads_them() -> None:
    with pytest.raises(InvalidTrajectory, match="teacher_logprobs: are needed by loss opd"):
        check_advantages_fit(record(0, teacher=False), LossSpec(type="opd"))
    with pytest.raises(InvalidTrajectory, match="teacher_logprobs: are read only with a distillation weight"):
        check_advantages_fit(record(0), LossSpec(type="grpo"))
    check_advantages_fit(record(0), LossSpec(type="grpo", distill_weight=0.1))
    short = record(1)
    short.teacher_logprobs = short.teacher_logprobs[:-1]
    with pytest.raises(InvalidTrajectory, match="teacher_logprobs: has"):
        validate_trajectory(short, 100, 0, LimitsSpec(), LossSpec(type="opd"))
    positive = record(1)
    positive.teacher_logprobs[0] = 0.5
    with pytest.raises(InvalidTrajectory, match="not a log-probability"):
        validate_trajectory(positive, 100, 0, LimitsSpec(), LossSpec(type="opd"))
    assert pack([record(2), record(3, teacher=False)]).teacher_logp is not None


def test_an_engine_pass_distils_the_same_whatever_the_micro_batches(dense_dir: Path) -> None:
    """The engine's loss is the formula on its own logprobs, split or whole; a step moves the student's
    logprobs toward the teacher's on the tokens (the reverse KL falls)."""
    batch = [record(i) for i in range(6)]
    loss = LossSpec(type="opd")
    whole = TorchEngine(make_spec(dense_dir, seed=3))
    split = TorchEngine(make_spec(dense_dir, micro_batch_tokens=12, seed=3))
    own = whole.compute_logprobs(batch)
    for r, lp in zip(batch, own, strict=True):  # on-policy: the behaviour logprobs are the student's own
        r.behavior_logprobs = lp
    m_whole, _ = whole.forward_with_logprobs(batch, loss)
    m_split, _ = split.forward_with_logprobs(batch, loss)
    tokens = sum(len(r.completion_token_ids) for r in batch)
    kl = sum(a - t for r in batch for a, t in zip(r.behavior_logprobs, r.teacher_logprobs, strict=True)) / tokens
    assert m_whole["distill_reverse_kl"] == pytest.approx(kl, rel=1e-4)
    assert m_whole["loss"] == pytest.approx(kl, rel=1e-4)  # ratio 1: token mean of -A = mean reverse KL
    assert m_split["loss"] == pytest.approx(m_whole["loss"], rel=1e-4)
    whole.optim_step()
    after = whole.compute_logprobs(batch)
    gap = [sum(abs(x - t) for x, t in zip(lp, r.teacher_logprobs, strict=True)) for lp, r in zip(own, batch,
                                                                                              strict=True)]
    gap_after = [sum(abs(x - t) for x, t in zip(lp, r.teacher_logprobs, strict=True))
                 for lp, r in zip(after, batch, strict=True)]
    assert sum(gap_after) < sum(gap) and math.isfinite(sum(gap_after))
