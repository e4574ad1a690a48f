"""The losses that take the caller's per-token advantages (cross_entropy, importance_sampling, token_ppo,
token_cispo: the Tinker API's), summed over tokens: their values and gradients against the formulas, the
logprobs a training pass returns, a forward-only pass, micro-batching, and what is refused."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from lorarl.contract.errors import SpecError
from lorarl.contract.training import LossSpec
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.losses import LossInputs, policy_loss
from lorarl.trainer.rl.trajectory import TrajectoryRecord
from lorarl.trainer.service.validation import InvalidTrajectory, check_advantages_fit
from tests.unit.trainer.engine_utils import make_spec


def formula(kind: str, logp: torch.Tensor, behaviour: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
            lo: float = 0.8, hi: float = 1.2) -> torch.Tensor:
    if kind == "cross_entropy":
        return (-(adv * logp) * mask).sum()
    ratio = (logp - behaviour).exp()
    if kind == "importance_sampling":
        return (-(ratio * adv) * mask).sum()
    if kind == "token_cispo":  # Tinker's: clipped_ratio.detach() * target_logprobs * advantages
        return (-(ratio.clamp(lo, hi).detach() * logp * adv) * mask).sum()
    return (-torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv) * mask).sum()


@pytest.mark.parametrize("kind", ["cross_entropy", "importance_sampling", "token_ppo", "token_cispo"])
def test_each_token_loss_is_its_formula_in_value_and_gradient(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen) * 2).requires_grad_()
    behaviour = logp.detach() + torch.randn(3, 5, generator=gen) * 0.5  # ratios well outside [0.8, 1.2]
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    loss, metrics = policy_loss(LossInputs(logp=logp, mask=mask, advantages=torch.zeros(3), behavior_logp=behaviour,
                                           token_advantages=adv), LossSpec(type=kind))
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_()
    expected = formula(kind, ref_logp, behaviour, adv, mask)
    (expected_grad,) = torch.autograd.grad(expected, ref_logp)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-6)
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-6) and metrics["tokens"] == 13
    if kind in ("token_ppo", "token_cispo"):
        assert 0 < metrics["clip_fraction"] < 1
    if kind == "token_cispo":  # unlike ppo's, a token past the clip keeps its gradient, at the clipped weight
        ratio = (logp.detach() - behaviour).exp()
        past = (mask > 0) & (ratio > 1.2)
        assert past.any() and (grad[past] != 0).all()


def test_token_losses_refuse_what_they_leave_to_the_caller() -> None:
    for field, value in [("kl_coef", 0.1), ("entropy_coef", 0.01), ("max_staleness", 0), ("dual_clip", 3.0),
                         ("behavior_weight_cap", 2.0)]:
        with pytest.raises(SpecError, match=f"loss.{field} must be unset with loss type importance_sampling"):
            LossSpec(type="importance_sampling", **{field: value})
    LossSpec(type="importance_sampling", behavior_weight_cap=0.0)  # 0 is "off": fine


def record(seed: int, advantages: bool = True) -> TrajectoryRecord:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 97) for _ in range(rng.randint(1, 4))]
    completion = [rng.randrange(1, 97) for _ in range(rng.randint(3, 7))]
    return TrajectoryRecord(prompt, completion, [-rng.uniform(0.5, 3.0) for _ in completion], [0] * len(completion),
                            reward=0.0, token_advantages=[rng.uniform(-1, 1) for _ in completion] if advantages
                            else None)


def test_advantages_go_with_the_losses_that_read_them() -> None:
    with pytest.raises(InvalidTrajectory, match=r"token_advantages: are read only by the token losses \(cross_entropy"):
        check_advantages_fit(record(0), LossSpec(type="grpo"))
    with pytest.raises(InvalidTrajectory, match="are needed by loss token_ppo"):
        check_advantages_fit(record(0, advantages=False), LossSpec(type="token_ppo"))
    check_advantages_fit(record(0, advantages=False), LossSpec(type="cross_entropy"))  # weights 1


def engine(dense_dir: Path, micro_batch_tokens: int = 0) -> TorchEngine:
    return TorchEngine(make_spec(dense_dir, micro_batch_tokens=micro_batch_tokens, seed=3))


@pytest.mark.parametrize("kind", ["cross_entropy", "importance_sampling", "token_ppo", "token_cispo"])
def test_a_training_pass_returns_its_logprobs_and_sums_over_micro_batches(dense_dir: Path, kind: str) -> None:
    """The summed loss does not depend on how the batch is split; the returned logprobs are the policy's own
    (what compute_logprobs says), and the loss is the formula on them."""
    batch = [record(i) for i in range(5)]
    loss = LossSpec(type=kind)
    whole, split = engine(dense_dir), engine(dense_dir, micro_batch_tokens=12)
    before = whole.compute_logprobs(batch)
    m_whole, lp_whole = whole.forward_with_logprobs(batch, loss)
    m_split, lp_split = split.forward_with_logprobs(batch, loss)
    assert m_whole["loss"] == pytest.approx(m_split["loss"], rel=1e-5)
    for got, want, other in zip(lp_whole, before, lp_split, strict=True):
        assert got == pytest.approx(want, abs=1e-5) and other == pytest.approx(want, abs=1e-5)
    expected = sum(float(formula(kind, torch.tensor(lp), torch.tensor(r.behavior_logprobs),
                                 torch.tensor(r.token_advantages), torch.ones(len(lp)), 0.8, 1.2))
                   for lp, r in zip(lp_whole, batch, strict=True))
    assert m_whole["loss"] == pytest.approx(expected, rel=1e-5)
    grads = [[p.grad.clone() for p in e._trainable if p.grad is not None] for e in (whole, split)]
    assert grads[0] and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads, strict=True))


def test_a_forward_only_pass_keeps_no_gradient_and_a_step_then_needs_one(dense_dir: Path) -> None:
    from lorarl.trainer.rl.step import EngineStateError

    e = engine(dense_dir)
    batch = [record(i) for i in range(3)]
    metrics, logprobs = e.forward_with_logprobs(batch, LossSpec(type="cross_entropy"), forward_only=True)
    assert math.isfinite(metrics["loss"]) and [len(lp) for lp in logprobs] == [len(r.completion_token_ids)
                                                                             for r in batch]
    assert all(p.grad is None or not p.grad.any() for p in e._trainable)
    with pytest.raises(EngineStateError):
        e.optim_step()
    trained, _ = e.forward_with_logprobs(batch, LossSpec(type="cross_entropy"))
    assert trained["loss"] == pytest.approx(metrics["loss"], rel=1e-5)  # eval and train passes agree (no dropout)
    e.optim_step()
    after, _ = e.forward_with_logprobs(batch, LossSpec(type="cross_entropy"), forward_only=True)
    assert after["loss"] < metrics["loss"]  # weights 1: a step of cross-entropy raises the tokens' likelihood
