"""GRPO-family policy losses on padded token tensors.

Shapes: per-token tensors are [B, T] (B completions, T completion tokens, right-padded) with a
float ``mask`` of 1 for real tokens. Per-sequence tensors are [B].

Decoupled PPO (asynchronous RL): the clipped ratio is taken against the *proximal* policy
(logprobs recomputed by the trainer before the step), and each token is re-weighted by
``proximal / behaviour`` (the policy that actually sampled it), capped; tokens produced more than
``max_staleness`` versions ago are masked out: lorarl.trainer.rl.step computes that mask once per
micro-batch (lorarl.contract.staleness) and hands it in as ``LossInputs.fresh``. With
``loss.rollout_correction`` set, its weights replace that capped weight and its rejection removes tokens
or sequences (lorarl.trainer.rl.correction, which also computes the rollout-vs-trainer monitor).

On-policy distillation (``opd``, or ``distill_weight`` beside any group loss): each token's advantage gains
``-distill_weight * (log pi_old - log pi_teacher)``, the sampled token's reverse KL to the prompt's teacher with
the teacher held fixed, evaluated at the policy the ratio is anchored to (pi_old: the proximal policy, else the
behaviour one). It is the sampled token's term, not a top-k sum: an action-independent penalty would give no
on-policy gradient (Miles #2362), and top-k reverse KL was unstable in verl (PR #5041). The ratio, clipping,
staleness mask and rollout corrections are the RL losses' own; ``rl_weight`` scales the reward's advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorarl.contract.training import KlName, LossSpec
from lorarl.trainer.rl.correction import SEQUENCE_METRICS, TOKEN_METRICS, correct

EPS = 1e-6


# ---------------------------------------------------------------- advantages


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-sequence advantages from rewards, relative to the other samples of the same prompt.

    grpo/dapo/gspo/ppo: (r - mean) / (std + eps); dr_grpo: r - mean (no std);
    rloo: r - mean of the *other* samples = n/(n-1) * (r - mean).
    """
    rewards = rewards.float()
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_index):
        sel = group_index == g
        r = rewards[sel]
        n = r.numel()
        mean = r.mean()
        if loss == "dr_grpo":
            adv[sel] = r - mean
        elif loss == "rloo":
            adv[sel] = (r - mean) * (n / (n - 1)) if n > 1 else torch.zeros_like(r)
        else:
            std = r.std(unbiased=True) if n > 1 else torch.zeros((), dtype=r.dtype)
            adv[sel] = (r - mean) / (std + EPS)
    return adv


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to max-buffer, then linearly down to -factor at max."""
    start = max_tokens - buffer
    over = (lengths.float() - start).clamp(min=0)
    return -(over / max(buffer, 1)).clamp(max=1.0) * factor


# ---------------------------------------------------------------- KL and entropy


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KlName) -> torch.Tensor:
    """Per-token KL(pi || ref) estimates from sampled tokens (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    neg = -log_ratio
    return neg.exp() - neg - 1.0


# ---------------------------------------------------------------- aggregation


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, norm_tokens: int = 0) -> torch.Tensor:
    """token-mean (DAPO): all tokens weigh the same; seq-mean-token-mean (GRPO): sequences weigh the
    same; seq-mean-token-sum-norm (Dr.GRPO): token sums divided by a constant length."""
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    if mode == "token-sum":  # the Tinker API's losses: each token's term as it is, the batch's total
        return (values * mask).sum()
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.mean()
    if mode == "seq-mean-token-sum-norm":
        denom = float(norm_tokens or values.shape[-1])
        return ((values * mask).sum(-1) / denom).mean()
    raise ValueError(f"unknown aggregation {mode!r}")


AGGREGATION = {
    "cross_entropy": "token-sum",
    "importance_sampling": "token-sum",
    "token_ppo": "token-sum",
    "token_cispo": "token-sum",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "rloo": "token-mean",
    "ppo": "token-mean",
    "gspo": "seq-mean-token-mean",
    "opd": "token-mean",
}


# ---------------------------------------------------------------- the loss


@dataclass
class LossInputs:
    """Everything the loss needs for one micro-batch."""

    logp: torch.Tensor  # [B, T] current policy, with grad
    mask: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    behavior_logp: torch.Tensor  # [B, T] policy that sampled the tokens
    proximal_logp: torch.Tensor | None = None  # [B, T] decoupled PPO; None: on-policy w.r.t. behaviour
    ref_logp: torch.Tensor | None = None  # [B, T] for the KL penalty
    entropy: torch.Tensor | None = None  # [B, T]
    fresh: torch.Tensor | None = None  # [B, T] 1 where a token is fresh enough to train (None: all); step.py's
    token_advantages: torch.Tensor | None = None  # [B, T] the caller's (token losses; cross_entropy: weights)
    current: torch.Tensor | None = None  # [B, T] 1 where the trainer's own version sampled a token (None: all)
    teacher_logp: torch.Tensor | None = None  # [B, T] the teachers' logprobs of the tokens (distillation)


def token_loss(inputs: LossInputs, settings: LossSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """The losses that take the caller's per-token advantages A, summed over tokens (the Tinker API's):
    cross_entropy -sum(A * logp); importance_sampling -sum(r * A); token_ppo -sum(min(r * A, clip(r) * A));
    token_cispo -sum(sg(clip(r)) * logp * A) (the clipped ratio a constant weight on the log-probability, so a
    token past the clip still moves, at the clip's weight); with r = exp(logp - behaviour logp) and clip to
    [1 - clip_eps_low, 1 + clip_eps_high]."""
    mask = inputs.mask.float()
    adv = inputs.token_advantages if inputs.token_advantages is not None else torch.ones_like(inputs.logp)
    if settings.type == "cross_entropy":
        per_token = -adv * inputs.logp
        ratio = clipped_mask = None
    else:
        ratio = (inputs.logp - inputs.behavior_logp).exp()
        per_token = -adv * ratio
        clipped_mask = torch.zeros_like(per_token)
        if settings.type == "token_ppo":
            clipped = -adv * ratio.clamp(1.0 - settings.clip_eps_low, 1.0 + settings.upper_clip)
            clipped_mask = (clipped > per_token).float()
            per_token = torch.maximum(per_token, clipped)
        elif settings.type == "token_cispo":
            weight = ratio.detach().clamp(1.0 - settings.clip_eps_low, 1.0 + settings.upper_clip)
            clipped_mask = (weight != ratio.detach()).float()
            per_token = -weight * inputs.logp * adv
    loss = aggregate(per_token, mask, "token-sum")
    # cross_entropy has no sampler's logprobs to compare with: its monitor reads 0
    monitor = dict.fromkeys((*TOKEN_METRICS, *SEQUENCE_METRICS), 0.0) if ratio is None else correct(
        inputs.logp, inputs.behavior_logp, mask, settings.rollout_correction, inputs.current).metrics
    metrics = {**monitor, "loss": float(loss.detach()), "pg_loss": float(loss.detach()), "tokens": float(mask.sum()),
               "clip_fraction": 0.0 if clipped_mask is None else float(aggregate(clipped_mask, mask, "token-mean")),
               "ratio_mean": 1.0 if ratio is None else float(aggregate(ratio.detach(), mask, "token-mean")),
               "behavior_logprob_abs_diff": 0.0 if ratio is None else float(aggregate(
                   (inputs.logp.detach() - inputs.behavior_logp).abs(), mask, "token-mean")),
               "importance_weight_mean": 1.0, "stale_token_fraction": 0.0}
    return loss, metrics


def policy_loss(inputs: LossInputs, settings: LossSpec, norm_tokens: int = 0
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns the scalar loss to minimise and detached metrics."""
    if settings.takes_token_advantages:
        return token_loss(inputs, settings)
    mask = inputs.mask.float()
    stale_frac = 0.0
    if inputs.fresh is not None:
        stale_frac = float(((1.0 - inputs.fresh) * mask).sum() / mask.sum().clamp(min=1.0))
        mask = mask * inputs.fresh

    old = inputs.proximal_logp if inputs.proximal_logp is not None else inputs.behavior_logp
    # The trainer's policy before the step: the proximal logprobs, or (one update per batch) the current ones.
    correction = correct(inputs.proximal_logp if inputs.proximal_logp is not None else inputs.logp,
                         inputs.behavior_logp, inputs.mask, settings.rollout_correction, inputs.current)
    mask = mask * correction.keep
    weight = torch.ones_like(inputs.logp)
    if inputs.proximal_logp is not None:
        if settings.rollout_correction.rollout_is is not None:
            weight = correction.weight
        else:
            weight = (inputs.proximal_logp - inputs.behavior_logp).exp()
            if settings.weight_cap:
                weight = weight.clamp(max=settings.weight_cap)
    weight = weight.detach()

    adv = settings.reward_scale * inputs.advantages.float()[:, None]
    reverse_kl = None
    if settings.distills:
        if inputs.teacher_logp is None:
            raise ValueError(f"loss {settings.type} distils (distill_weight {settings.distill_scale}) but the batch "
                             "has no teacher logprobs")
        reverse_kl = (old.detach() - inputs.teacher_logp) * inputs.mask
        adv = adv - settings.distill_scale * reverse_kl
    lo, hi = 1.0 - settings.clip_eps_low, 1.0 + settings.upper_clip
    if settings.type == "gspo":
        # Sequence-level ratio: geometric mean of token ratios, gradient through every token.
        log_ratio = (inputs.logp - old.detach()) * mask
        seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)
        ratio = (seq_log_ratio.detach()[:, None] + inputs.logp - inputs.logp.detach()).exp()
    else:
        ratio = (inputs.logp - old.detach()).exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(lo, hi)
    per_token = torch.maximum(unclipped, clipped)
    clipped_mask = (clipped > unclipped).float()
    if settings.dual_clip:
        dual = torch.minimum(per_token, -adv * settings.dual_clip)
        per_token = torch.where(adv < 0, dual, per_token)
    per_token = per_token * weight

    mode = AGGREGATION[settings.type]
    loss = aggregate(per_token, mask, mode, norm_tokens)
    metrics: dict[str, float] = {
        **correction.metrics,
        "pg_loss": float(loss.detach()),
        "clip_fraction": float(aggregate(clipped_mask, mask, "token-mean")),
        "ratio_mean": float(aggregate(ratio.detach(), mask, "token-mean")),
        # How far the sampler's logprobs are from the trainer's own (0 on-policy with exact sync).
        "behavior_logprob_abs_diff": float(aggregate((inputs.logp.detach() - inputs.behavior_logp).abs(), mask,
                                                     "token-mean")),
        "importance_weight_mean": float(aggregate(weight, mask, "token-mean")),
        "stale_token_fraction": stale_frac,
        "tokens": float(mask.sum()),
    }
    if reverse_kl is not None:
        metrics["distill_reverse_kl"] = float(aggregate(reverse_kl, mask, "token-mean"))
    if inputs.ref_logp is not None:
        kl = kl_penalty(inputs.logp, inputs.ref_logp.detach(), settings.kl_estimator)
        kl_value = aggregate(kl, mask, mode, norm_tokens)
        metrics["kl"] = float(kl_value.detach())
        if settings.kl_coef:
            loss = loss + settings.kl_coef * kl_value
    if inputs.entropy is not None:
        ent = aggregate(inputs.entropy, mask, mode, norm_tokens)
        metrics["entropy"] = float(ent.detach())
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * ent
    metrics["loss"] = float(loss.detach())
    return loss, metrics
