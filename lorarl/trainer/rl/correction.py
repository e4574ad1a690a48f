"""Rollout correction and the mismatch monitor: how far the rollout's sampler (mu) is from the trainer's own
policy before the step (pi_old), and what the loss does about it.

Shapes as in lorarl.trainer.rl.losses: [B, T] per completion token with a float ``mask`` of the policy's
tokens, a row per sequence. With rho_t = pi_old(y_t) / mu(y_t), everything detached:

    log rho_t   = clamp(log pi_old - log mu, -20, 20)           (verl's safety bound)
    token TIS   w_t = min(rho_t, C)                              rollout_is: token
    seq TIS     w   = min(exp(sum_t log rho_t), C)               rollout_is: sequence (every token of the row)
    IcePop      w   = rho if low <= rho <= C else 0              rollout_is + rollout_is_threshold_low
    token RS    keep_t = low <= rho_t <= high                    rollout_rs: token
    Seq-MIS     keep   = low <= exp(sum_t log rho_t) <= high     rollout_rs: sequence
    Geo-RS      keep   = low <= exp(mean_t log rho_t) <= high    rollout_rs: geometric
    K3-RS       keep   = mean_t (rho_t - 1 - log rho_t) <= high  rollout_rs: k3

The monitor (every step, whatever is configured) estimates KL(mu || pi_old) from the rollout's samples:
k1 = mean_t (log mu - log pi_old), k3 = mean_t (rho_t - 1 - log rho_t); and counts the tokens and sequences
whose ratio is outside [1/C, C]. Over every token that KL also holds the policy's movement since a stale
token's version; over the *current* tokens alone (sampled by the version the trainer holds) it is the
rollout-vs-trainer mismatch and nothing else, which is what the loop's mismatch alarm reads
(``rollout_kl_k3_current``, when a batch has such tokens; lorarl.client.rl.mismatch). A rejected token
leaves the loss and its denominator (lorarl.trainer.rl.step counts only kept tokens and sequences in a
batch's totals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorarl.contract.training import ROLLOUT_IS_THRESHOLD, CorrectionSpec

#: verl's bound on log rho before any exp: a ratio past e^20 is noise, not information.
LOG_RATIO_BOUND = 20.0
#: Token-weighted monitor metrics (means over the policy's tokens) and sequence-weighted ones.
TOKEN_METRICS = ("rollout_kl_k1", "rollout_kl_k3", "rollout_token_past_fraction", "rollout_is_weight_mean",
                 "rollout_masked_token_fraction", "rollout_current_token_fraction", "rollout_kl_k3_current_share")
SEQUENCE_METRICS = ("rollout_seq_past_fraction", "rollout_masked_seq_fraction")


@dataclass
class Correction:
    """What the loss applies to a micro-batch: a weight per token (1 without ``rollout_is``) and the tokens it
    keeps (1/0; all of them without ``rollout_rs``), with the monitor's per-micro-batch means."""

    weight: torch.Tensor  # [B, T]
    keep: torch.Tensor  # [B, T]
    metrics: dict[str, float]


def log_ratio(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log rho_t, bounded, 0 off the mask (padding, tool tokens)."""
    return (train_logp.detach() - rollout_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) * mask


def _between(value: torch.Tensor, low: float | None, high: float) -> torch.Tensor:
    inside = value <= high
    return inside & (value >= low) if low is not None else inside


def correct(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
            spec: CorrectionSpec, current: torch.Tensor | None = None) -> Correction:
    """The weights, the kept tokens and the monitor's figures of one micro-batch. ``current``: 1 where a token
    was sampled by the trainer's own version (None: every token was)."""
    mask = mask.float()
    log_rho = log_ratio(train_logp, rollout_logp, mask)
    rho = log_rho.exp()
    k3 = (rho - 1.0 - log_rho) * mask
    tokens = mask.sum(-1)
    has_tokens = tokens > 0
    seq_log_rho = log_rho.sum(-1)

    weight = torch.ones_like(rho)
    if spec.rollout_is is not None:
        ratio = rho if spec.rollout_is == "token" else seq_log_rho.exp()[:, None].expand_as(rho)
        if spec.rollout_is_threshold_low is not None:
            weight = torch.where(_between(ratio, spec.rollout_is_threshold_low, spec.rollout_is_threshold),
                                 ratio, torch.zeros_like(ratio))
        else:
            weight = ratio.clamp(max=spec.rollout_is_threshold)

    keep = torch.ones_like(rho)
    if spec.rollout_rs is not None:
        low, high = spec.rs_bounds
        if spec.rollout_rs == "token":
            keep = _between(rho, low, high).float()
        else:
            if spec.rollout_rs == "sequence":
                seq_value = seq_log_rho.exp()
            elif spec.rollout_rs == "geometric":
                seq_value = (seq_log_rho / tokens.clamp(min=1.0)).exp()
            else:
                seq_value = k3.sum(-1) / tokens.clamp(min=1.0)
            keep = _between(seq_value, low, high).float()[:, None].expand_as(rho)

    weight, keep = weight * mask, keep * mask
    n_tokens = float(tokens.sum().clamp(min=1.0))
    n_seqs = float(max(int(has_tokens.sum()), 1))
    cap = spec.rollout_is_threshold if spec.rollout_is is not None else ROLLOUT_IS_THRESHOLD
    token_past = ((rho > cap) | (rho < 1.0 / cap)).float() * mask
    seq_rho = seq_log_rho.exp()
    seq_past = ((seq_rho > cap) | (seq_rho < 1.0 / cap)) & has_tokens
    masked_tokens = mask - keep
    current = mask if current is None else current.float() * mask
    metrics = {
        "rollout_kl_k1": float((-log_rho).sum()) / n_tokens,
        "rollout_kl_k3": float(k3.sum()) / n_tokens,
        "rollout_token_past_fraction": float(token_past.sum()) / n_tokens,
        "rollout_is_weight_mean": float(weight.sum()) / n_tokens,
        "rollout_masked_token_fraction": float(masked_tokens.sum()) / n_tokens,
        # per policy token, so they average like the rest; current_kl turns the two into the current tokens' KL
        "rollout_current_token_fraction": float(current.sum()) / n_tokens,
        "rollout_kl_k3_current_share": float((k3 * current).sum()) / n_tokens,
        "rollout_seq_past_fraction": float(seq_past.sum()) / n_seqs,
        "rollout_masked_seq_fraction": float(((keep.sum(-1) == 0) & has_tokens).sum()) / n_seqs,
    }
    return Correction(weight=weight.detach(), keep=keep.detach(), metrics=metrics)


def current_kl(metrics: dict[str, float]) -> None:
    """Replaces a batch's ``rollout_kl_k3_current_share`` by ``rollout_kl_k3_current``, the mean KL over the
    tokens its trainer's own version sampled: absent when it has none (a trainer-bound async step)."""
    share = metrics.pop("rollout_kl_k3_current_share", 0.0)
    fraction = metrics.get("rollout_current_token_fraction", 0.0)
    if fraction > 0:
        metrics["rollout_kl_k3_current"] = share / fraction


def kept_counts(keep: torch.Tensor, fresh: torch.Tensor | None) -> tuple[float, float]:
    """(loss tokens, sequences) of a micro-batch after rejection: its tokens kept and fresh, its rows not
    rejected whole (a sequence whose tokens are all stale still counts, as without rejection). What the
    batch's totals count, so a rejected token or sequence leaves the loss's denominator too."""
    tokens = keep if fresh is None else keep * fresh
    return float(tokens.sum()), float((keep.sum(-1) > 0).sum())
