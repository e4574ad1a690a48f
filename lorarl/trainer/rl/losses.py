"""GRPO-family policy losses on padded token tensors.

Shapes: per-token tensors are [B, T] (B completions, T completion tokens, right-padded) with a
float ``mask`` of 1 for real tokens. Per-sequence tensors are [B].

Decoupled PPO (asynchronous RL): the clipped ratio is taken against the *proximal* policy
(logprobs recomputed by the trainer before the step), and each token is re-weighted by
``proximal / behaviour`` (the policy that actually sampled it), capped; tokens produced more than
``max_staleness`` versions ago are masked out (lorarl.contract.staleness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from lorarl.contract import staleness

KlName = Literal["k1", "k2", "k3"]
LOSS_NAMES = ("grpo", "dr_grpo", "dapo", "rloo", "gspo", "ppo")
EPS = 1e-6


@dataclass(frozen=True)
class LossSettings:
    """Knobs of the policy loss; mirrors lorarl.v1.LossConfig."""

    name: str = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: KlName = "k3"
    behavior_weight_cap: float = 0.0
    max_staleness: int | None = None  # None: no token is masked for its age; 0: only the current version's
    overlong_buffer: int = 0
    overlong_penalty: float = 0.0
    max_response_tokens: int = 0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high", "dual_clip", "kl_coef", "behavior_weight_cap",
                     "overlong_penalty", "entropy_coef"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"loss.{name} must be a finite number, got {getattr(self, name)}")
        if self.name not in LOSS_NAMES:
            raise ValueError(f"loss.type must be one of {list(LOSS_NAMES)}, got {self.name!r}")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError("loss.clip_eps_low and loss.clip_eps_high must be >= 0")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"loss.dual_clip must be > 1 (or 0 to disable), got {self.dual_clip}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"loss.kl_estimator must be k1, k2 or k3, got {self.kl_estimator!r}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"loss.max_staleness must be >= 0 (or unset), got {self.max_staleness}")
        if self.behavior_weight_cap < 0:
            raise ValueError("loss.behavior_weight_cap must be >= 0 (0 disables)")
        if self.overlong_buffer and not self.max_response_tokens:
            raise ValueError("loss.overlong_buffer needs loss.max_response_tokens")


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
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.mean()
    if mode == "seq-mean-token-sum-norm":
        denom = float(norm_tokens or values.shape[-1])
        return ((values * mask).sum(-1) / denom).mean()
    raise ValueError(f"unknown aggregation {mode!r}")


AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "rloo": "token-mean",
    "ppo": "token-mean",
    "gspo": "seq-mean-token-mean",
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
    token_versions: torch.Tensor | None = None  # [B, T]
    current_version: int = 0


def policy_loss(inputs: LossInputs, settings: LossSettings, norm_tokens: int = 0
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns the scalar loss to minimise and detached metrics."""
    mask = inputs.mask.float()
    stale_frac = 0.0
    if settings.max_staleness is not None and inputs.token_versions is not None:
        fresh = staleness.fresh(inputs.current_version, inputs.token_versions, settings.max_staleness)
        stale_frac = float(((~fresh).float() * mask).sum() / mask.sum().clamp(min=1.0))
        mask = mask * fresh.float()

    old = inputs.proximal_logp if inputs.proximal_logp is not None else inputs.behavior_logp
    weight = torch.ones_like(inputs.logp)
    if inputs.proximal_logp is not None:
        weight = (inputs.proximal_logp - inputs.behavior_logp).exp()
        if settings.behavior_weight_cap:
            weight = weight.clamp(max=settings.behavior_weight_cap)
    weight = weight.detach()

    adv = inputs.advantages.float()[:, None]
    lo, hi = 1.0 - settings.clip_eps_low, 1.0 + settings.clip_eps_high
    if settings.name == "gspo":
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

    mode = AGGREGATION[settings.name]
    loss = aggregate(per_token, mask, mode, norm_tokens)
    metrics: dict[str, float] = {
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
