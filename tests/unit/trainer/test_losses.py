"""RL losses against values computed by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.contract import staleness
from lorarl.trainer.rl.losses import (
    LossInputs,
    LossSpec,
    aggregate,
    group_advantages,
    kl_penalty,
    overlong_penalty,
    policy_loss,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])


def test_grpo_advantages_are_group_normalised() -> None:
    adv = group_advantages(REWARDS, GROUPS, "grpo")
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1,0,0,1]
    expected = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)


def test_dr_grpo_advantages_skip_std() -> None:
    assert group_advantages(REWARDS, GROUPS, "dr_grpo").tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0])


def test_rloo_advantages_leave_one_out() -> None:
    adv = group_advantages(REWARDS, GROUPS, "rloo")
    # sample 0: 1 - mean(0, 0, 1) = 2/3 ; sample 1: 0 - mean(1, 0, 1) = -2/3
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0], rel=1e-6)


def test_overlong_penalty_is_linear_in_the_buffer() -> None:
    pen = overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_tokens=20, buffer=4, factor=1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_kl_estimators() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_aggregations() -> None:
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, m, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(v, m, "seq-mean-token-sum-norm", norm_tokens=5).item() == pytest.approx((6 / 5 + 4 / 5) / 2)


def two_token_inputs(logp: list[float], old: list[float], adv: float) -> LossInputs:
    return LossInputs(logp=torch.tensor([logp], requires_grad=True), mask=torch.ones(1, len(logp)),
                      advantages=torch.tensor([adv]), behavior_logp=torch.tensor([old]))


def test_ppo_clip_by_hand() -> None:
    # ratios e^0.5 = 1.6487 (clipped to 1.2) and e^-0.5 = 0.6065 (clipped to 0.8); advantage +1.
    inputs = two_token_inputs([0.0, -1.0], [-0.5, -0.5], adv=1.0)
    loss, metrics = policy_loss(inputs, LossSpec(type="ppo"))
    # token 1: max(-1.6487, -1.2) = -1.2 ; token 2: max(-0.6065, -0.8) = -0.6065
    assert loss.item() == pytest.approx((-1.2 - math.exp(-0.5)) / 2, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # clipped token gets no gradient; unclipped: d/dlogp (-ratio)/2 = -ratio/2
    assert inputs.logp.grad.tolist()[0] == pytest.approx([0.0, -math.exp(-0.5) / 2], rel=1e-5)


def test_dapo_asymmetric_clip() -> None:
    inputs = two_token_inputs([0.0, 0.0], [-0.5, -0.5], adv=1.0)
    loss, _ = policy_loss(inputs, LossSpec(type="dapo", clip_eps_low=0.2, clip_eps_high=0.28))
    assert loss.item() == pytest.approx(-1.28, rel=1e-5)


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    # ratio e^2 = 7.39 with advantage -1: plain PPO loss 7.39, dual clip c=3 caps it at 3.
    inputs = two_token_inputs([0.0], [-2.0], adv=-1.0)
    plain, _ = policy_loss(inputs, LossSpec(type="ppo"))
    dual, _ = policy_loss(inputs, LossSpec(type="ppo", dual_clip=3.0))
    assert plain.item() == pytest.approx(math.exp(2.0), rel=1e-5)
    assert dual.item() == pytest.approx(3.0)


def test_gspo_uses_sequence_ratio() -> None:
    # token log-ratios 0.1 and 0.3 -> sequence ratio s = e^0.2 = 1.2214, inside a 0.3 clip range.
    inputs = two_token_inputs([-0.9, -0.7], [-1.0, -1.0], adv=2.0)
    loss, _ = policy_loss(inputs, LossSpec(type="gspo", clip_eps_low=0.3, clip_eps_high=0.3))
    assert loss.item() == pytest.approx(-2.0 * math.exp(0.2), rel=1e-5)
    loss.backward()
    # grad of -A * s with s = exp(mean_t log-ratio_t): -A * s / |y| on every token
    assert inputs.logp.grad.tolist()[0] == pytest.approx([-2.0 * math.exp(0.2) / 2] * 2, rel=1e-5)
    # with the default 0.2 range the sequence ratio is clipped at 1.2 for the whole sequence
    clipped, metrics = policy_loss(two_token_inputs([-0.9, -0.7], [-1.0, -1.0], adv=2.0), LossSpec(type="gspo"))
    assert clipped.item() == pytest.approx(-2.4, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(1.0)


def test_grpo_sequence_mean_vs_dapo_token_mean() -> None:
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    inputs = LossInputs(logp=logp, mask=mask, advantages=torch.tensor([1.0, -1.0]), behavior_logp=torch.zeros(2, 3))
    grpo, _ = policy_loss(inputs, LossSpec(type="grpo"))
    dapo, _ = policy_loss(inputs, LossSpec(type="dapo"))
    assert grpo.item() == pytest.approx(0.0)  # (-1 + 1) / 2
    assert dapo.item() == pytest.approx((-3 + 1) / 4)


def test_decoupled_ppo_weights_and_staleness_mask() -> None:
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    inputs = LossInputs(
        logp=logp, mask=torch.ones(1, 3), advantages=torch.tensor([1.0]),
        behavior_logp=torch.tensor([[-2.0, -1.0, -1.0]]),
        proximal_logp=torch.tensor([[-1.0, -1.0, -1.0]]),
        fresh=staleness.fresh(5, torch.tensor([[5, 5, 1]]), 2).float(),
    )
    loss, metrics = policy_loss(inputs, LossSpec(type="ppo", behavior_weight_cap=2.0, max_staleness=2))
    # token 0: weight e^1 = 2.718 capped at 2; token 1: weight 1; token 2: 4 versions stale -> masked.
    assert loss.item() == pytest.approx((-2.0 - 1.0) / 2, rel=1e-5)
    assert metrics["stale_token_fraction"] == pytest.approx(1 / 3)
    assert metrics["importance_weight_mean"] == pytest.approx(1.5)


def test_kl_penalty_added_to_loss() -> None:
    inputs = two_token_inputs([-1.0, -1.0], [-1.0, -1.0], adv=0.0)
    inputs.ref_logp = torch.tensor([[-1.5, -1.5]])
    loss, metrics = policy_loss(inputs, LossSpec(type="ppo", kl_coef=0.1, kl_estimator="k1"))
    assert metrics["kl"] == pytest.approx(0.5)
    assert loss.item() == pytest.approx(0.05)


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"loss\.type"):
        LossSpec(type="sft")
    with pytest.raises(ValueError, match="dual_clip"):
        LossSpec(dual_clip=0.5)
