"""One RL step on a batch of trajectories, over any model backend and any gradient reducer.

The algorithm on one page; engines only say how to run the model (a `ModelBackend`) and how ranks
combine their parts (a `GradientReducer`):

    proximal   = logprobs(policy) of every micro-batch   if rollout rejection is on  # no_grad, first
    totals     = reduce(counts of sequences, tokens, fresh (and kept) tokens, Dr.GRPO length)   # whole batch
    advantages = group_advantages(shaped rewards)                                    # before splitting
    for micro in split(batch, micro_batch_tokens):
        proximal = logprobs(policy)          if decoupled PPO (and dropout on)       # no_grad, before any update
        ref      = logprobs(adapters off)    if kl_coef > 0                          # no second model copy
        logp, entropy = logprobs(policy)                                             # with grad
        (policy_loss(...) * share(micro)).backward()                                 # share: tokens or sequences
    for the reducer's idle micro-steps: the same passes on an empty batch            # ranks in lockstep

``share`` makes the accumulated gradient equal to the gradient of the full-batch loss: token-mean
losses weigh a micro-batch by its share of loss tokens, per-sequence losses (GRPO's seq-mean,
Dr.GRPO's constant-normalised sums) by its share of sequences; Dr.GRPO's constant is
``loss.max_response_tokens`` when set, else the longest completion of the whole batch. Data-parallel
ranks use the same rule with global totals (the reducer's), so the SUM of their gradients is the
full-batch gradient. Tokens too old for ``loss.max_staleness`` (lorarl.contract.staleness) count in
neither the loss nor its shares; nor do tokens and sequences ``loss.rollout_correction.rollout_rs`` rejects,
which is why rejection reads every micro-batch's proximal logprobs in a pass of its own before the first
backward (lorarl.trainer.rl.correction). The optimiser step, the schedule and the version stay with the
engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from lorarl.contract import staleness
from lorarl.trainer.rl.batching import PackedBatch, compute_advantages, micro_batches, pack
from lorarl.trainer.rl.correction import SEQUENCE_METRICS, TOKEN_METRICS, correct, current_kl, kept_counts
from lorarl.trainer.rl.losses import AGGREGATION, LossInputs, LossSpec, policy_loss
from lorarl.trainer.rl.trajectory import TrajectoryRecord

Metrics = dict[str, float]
# Metrics averaged over loss weight (the micro-batch's share of the loss) vs over its share of tokens.
LOSS_WEIGHTED = ("loss", "pg_loss", "kl", "entropy")
TOKEN_WEIGHTED = ("clip_fraction", "ratio_mean", "importance_weight_mean", "behavior_logprob_abs_diff")
# Token-weighted too, reported only where the loss computes them (a distilling loss's reverse KL to its teachers).
OPTIONAL_TOKEN_WEIGHTED = ("distill_reverse_kl",)
# The rollout-vs-trainer monitor's: over every policy token (stale or rejected too), or every sequence.
RAW_TOKEN_WEIGHTED = ("stale_token_fraction", *TOKEN_METRICS)
# (logp, entropy) of a micro-batch -> (its loss share to backpropagate, the loss metrics)
LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


class EngineStateError(RuntimeError):
    """The call is valid but not now (e.g. optim_step with no accumulated gradients)."""


@dataclass
class BatchTotals:
    """Whole-batch counts every micro-batch's loss share is measured against (global under DP)."""

    sequences: float
    tokens: float  # completion tokens
    loss_tokens: float  # completion tokens that count in the loss (not masked as stale, nor rejected)
    norm_tokens: int  # Dr.GRPO's constant length normaliser
    loss_sequences: float = -1.0  # sequences that count in the loss (not rejected); -1: all of them

    def __post_init__(self) -> None:
        if self.loss_sequences < 0:
            self.loss_sequences = self.sequences


@dataclass(frozen=True)
class Shares:
    """A micro-batch's weights in the whole batch's figures: its loss's, its loss tokens', its policy tokens'
    (stale and rejected ones too: the monitor's) and its sequences'."""

    loss: float
    tokens: float
    raw_tokens: float
    sequences: float


def rejects(settings: LossSpec) -> bool:
    """Whether rollout rejection may drop tokens, so the batch's totals need its proximal logprobs first."""
    return settings.rollout_correction.rollout_rs is not None


class ModelBackend(Protocol):
    """How a model computes what the RL step needs; the torch and Megatron engines are backends."""

    device: torch.device

    def completion_logprobs(self, batch: PackedBatch, entropy_grad: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [B, T] of the completion tokens and the entropy [B, T] at each of them."""

    def adapters_off(self) -> contextlib.AbstractContextManager[None]:
        """Every adapter switched off: the reference policy."""

    def set_training(self, training: bool) -> None:
        """train() / eval() on the model (dropout on only while computing the loss)."""

    def loss_backward(self, batch: PackedBatch, entropy_grad: bool, loss_fn: LossFn) -> dict[str, float]:
        """Forward with grad, ``loss_fn(logp, entropy)``, backward; the loss metrics (pipelines run their
        own schedule: the loss exists on the last stage only)."""

    def before_micro_batch(self, batch: PackedBatch) -> None:
        """Readies the model for this micro-batch's with-grad pass (e.g. activation checkpointing on or off)."""

    def dropout_free(self) -> bool:
        """Whether a training-mode forward equals an eval-mode one (no LoRA or model dropout)."""


class GradientReducer(Protocol):
    """How the ranks that share one step combine their parts: counts, metrics, gradients, micro-steps."""

    def reduce_totals(self, totals: BatchTotals) -> BatchTotals: ...

    def reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]: ...

    def sync_gradients(self, params: Sequence[nn.Parameter]) -> None: ...

    def idle_micro_steps(self, planned: int) -> int:
        """How many idle micro-steps follow this rank's ``planned`` ones, so that ranks whose forward
        passes are collectives (expert parallelism) run as many."""


class LocalReducer:
    """One process: nothing to combine."""

    def reduce_totals(self, totals: BatchTotals) -> BatchTotals:
        return totals

    def reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def sync_gradients(self, params: Sequence[nn.Parameter]) -> None:
        return None

    def idle_micro_steps(self, planned: int) -> int:
        return 0


def fresh_tokens(batch: PackedBatch, settings: LossSpec, version: int) -> torch.Tensor | None:
    """Which of a micro-batch's tokens are fresh enough to train ``version`` (1.0 / 0.0; None: every one, no
    bound): the one staleness mask of a micro-batch, which its loss share and the loss both use."""
    if settings.max_staleness is None:
        return None
    return staleness.fresh(version, batch.token_versions, settings.max_staleness).float()


def batch_totals(records: Sequence[TrajectoryRecord], settings: LossSpec, version: int,
                 kept: Sequence[tuple[float, float]] | None = None) -> BatchTotals:
    """This process's counts of ``records`` (before any reduction): the whole batch's, needed before its
    first micro-batch; ``loss_tokens`` counts the tokens each micro-batch's ``fresh_tokens`` keeps.
    ``kept``: each micro-batch's (loss tokens, sequences) after rollout rejection, which then replace them."""
    tokens = sum(r.trained_tokens for r in records)
    loss_tokens = tokens
    if settings.max_staleness is not None:
        loss_tokens = sum(1 for r in records for v, trained in zip(r.token_versions, r.trained(), strict=False)
                          if trained and staleness.fresh(version, v, settings.max_staleness))
    norm = settings.max_response_tokens or max((r.trained_tokens for r in records), default=0)
    if kept is not None:
        return BatchTotals(float(len(records)), float(tokens), sum(t for t, _ in kept), int(norm),
                           sum(s for _, s in kept))
    return BatchTotals(float(len(records)), float(tokens), float(loss_tokens), int(norm))


def empty_batch(device: torch.device) -> PackedBatch:
    """A batch of no sequences (shapes [0, 1]): what an idle micro-step feeds the model."""
    ids = torch.zeros(0, 1, dtype=torch.long, device=device)
    zeros = torch.zeros(0, 1, device=device)
    return PackedBatch(input_ids=ids, attention_mask=ids, target_positions=ids, completion_ids=ids, mask=zeros,
                       behavior_logp=zeros, token_versions=ids, advantages=torch.zeros(0, device=device),
                       completion_lengths=torch.zeros(0, dtype=torch.long, device=device))


class RLStep:
    """Accumulates one batch's policy-gradient into the backend's trainable parameters."""

    def __init__(self, backend: ModelBackend, reducer: GradientReducer, *, micro_batch_tokens: int,
                 decoupled: Callable[[LossSpec], bool], has_reference: bool) -> None:
        self.backend = backend
        self.reducer = reducer
        self.micro_batch_tokens = micro_batch_tokens
        self._decoupled = decoupled  # whether decoupled PPO applies under these loss settings
        self.has_reference = has_reference  # adapters to switch off (a full fine-tune has none)

    # ------------------------------------------------------------ passes without gradient

    @torch.no_grad()
    def logprobs_no_grad(self, batch: PackedBatch, reference: bool = False) -> torch.Tensor:
        self.backend.set_training(False)
        if reference:
            if not self.has_reference:
                raise EngineStateError("reference logprobs need adapters; a full fine-tune has no frozen reference")
            with self.backend.adapters_off():
                return self.backend.completion_logprobs(batch)[0]
        return self.backend.completion_logprobs(batch)[0]

    def compute_logprobs(self, records: Sequence[TrajectoryRecord], reference: bool = False) -> list[list[float]]:
        """Per completion token logprobs of ``records`` under the policy, or the reference."""
        out: list[list[float]] = [[] for _ in records]
        for idx in micro_batches([r.num_tokens for r in records], self.micro_batch_tokens):
            micro = pack([records[i] for i in idx]).to(self.backend.device)
            logp = self.logprobs_no_grad(micro, reference=reference).cpu()
            for row, i in enumerate(idx):
                out[i] = logp[row, : len(records[i].completion_token_ids)].tolist()
        return out

    def needs_proximal_pass(self, settings: LossSpec) -> bool:
        """Whether decoupled PPO's proximal logprobs need a no-grad pass of their own (else they are read
        off the with-grad forward); a micro-step and an idle micro-step must run the same passes."""
        return self._decoupled(settings) and not self.backend.dropout_free()

    # ------------------------------------------------------------ the step

    def forward_backward(self, records: Sequence[TrajectoryRecord], settings: LossSpec, version: int,
                         logprobs_out: list[list[float]] | None = None, forward_only: bool = False) -> Metrics:
        """Accumulates gradients; metrics are full-batch values: loss, pg_loss, entropy, clip_fraction,
        ratio_mean, importance_weight_mean, stale_token_fraction, kl (only when kl_coef > 0, the only
        case the reference pass runs), tokens, loss_tokens, sequences, version, time_s.

        ``logprobs_out``: filled with each record's completion-token logprobs from the same forward pass.
        ``forward_only``: the same loss and metrics, no gradient (eval mode, no idle micro-steps: a forward
        without gradient has no collective a data-parallel peer waits on)."""
        start = time.perf_counter()
        records = list(records)
        if settings.kl_coef and not self.has_reference:
            raise ValueError("loss.kl_coef must be 0 with full_finetune (no frozen reference policy)")
        plan = micro_batches([r.num_tokens for r in records], self.micro_batch_tokens)
        idle = 0 if forward_only else self.reducer.idle_micro_steps(len(plan))
        proximals = self._rejection_pass(records, plan, idle, settings, version) if rejects(settings) else None
        kept = None if proximals is None else [counts for _, counts in proximals]
        totals = self.reducer.reduce_totals(batch_totals(records, settings, version, kept))
        if not totals.tokens:
            raise ValueError("trajectories must hold at least one completion token")
        advantages = compute_advantages(records, settings)
        # A fixed key set, so data-parallel ranks (even one with an empty shard) reduce alike.
        keys = [*LOSS_WEIGHTED, *TOKEN_WEIGHTED, *RAW_TOKEN_WEIGHTED, *SEQUENCE_METRICS]
        sums = {k: 0.0 for k in keys if k != "kl" or settings.kl_coef}
        sums.update(dict.fromkeys(OPTIONAL_TOKEN_WEIGHTED if settings.distills else (), 0.0))
        if logprobs_out is not None:
            logprobs_out[:] = [[] for _ in records]
        for n, idx in enumerate(plan):
            micro = pack([records[i] for i in idx], advantages[idx]).to(self.backend.device)
            seen: list[torch.Tensor] = []
            step = self._forward_step if forward_only else self._micro_step
            proximal = None if proximals is None else proximals[n][0]
            for key, value in step(micro, settings, totals, version, seen, proximal).items():
                sums[key] += value
            if logprobs_out is not None:
                if len(seen) != 1:  # e.g. a pipeline stage that does not compute the loss
                    raise EngineStateError("this rank's backend did not compute the micro-batch's logprobs once")
                logp = seen[0].float().cpu()
                for row, i in enumerate(idx):
                    logprobs_out[i] = logp[row, : len(records[i].completion_token_ids)].tolist()
        for _ in range(idle):
            self._idle_micro_step(settings, proximal_given=proximals is not None)
        metrics = self.reducer.reduce_metrics(sums)
        current_kl(metrics)
        metrics.update(tokens=totals.tokens, loss_tokens=totals.loss_tokens, sequences=totals.sequences,
                       version=float(version), time_s=time.perf_counter() - start)
        return metrics

    @staticmethod
    def _shares(batch: PackedBatch, settings: LossSpec, totals: BatchTotals, fresh: torch.Tensor | None,
                proximal: torch.Tensor | None = None) -> Shares:
        """A micro-batch's shares of the whole batch. ``proximal`` (given when rollout rejection is on): only
        its kept tokens count in its token share, as only the batch's kept ones count in ``totals``."""
        mask = batch.mask if fresh is None else batch.mask * fresh
        if proximal is not None:
            mask = mask * correct(proximal, batch.behavior_logp, batch.mask, settings.rollout_correction).keep
        token_share = float(mask.sum()) / totals.loss_tokens if totals.loss_tokens else 0.0
        # GRPO's and Dr.GRPO's per-sequence means divide by the micro-batch's rows (a rejected row adds a 0), so
        # its share is its rows over the batch's sequences that count
        sequence_share = batch.size / totals.loss_sequences if totals.loss_sequences else 0.0
        share = {"token-mean": token_share, "token-sum": 1.0}.get(AGGREGATION[settings.type], sequence_share)
        raw_token_share = float(batch.mask.sum()) / totals.tokens if totals.tokens else 0.0
        return Shares(share, token_share, raw_token_share, batch.size / totals.sequences)

    @staticmethod
    def _weighted(m: dict[str, float], shares: Shares) -> dict[str, float]:
        out = {k: m[k] * shares.loss for k in LOSS_WEIGHTED if k in m}
        out.update({k: m[k] * shares.tokens for k in TOKEN_WEIGHTED})
        out.update({k: m[k] * shares.tokens for k in OPTIONAL_TOKEN_WEIGHTED if k in m})
        out.update({k: m[k] * shares.raw_tokens for k in RAW_TOKEN_WEIGHTED})
        out.update({k: m[k] * shares.sequences for k in SEQUENCE_METRICS})
        return out

    @torch.no_grad()
    def _rejection_pass(self, records: Sequence[TrajectoryRecord], plan: list[list[int]], idle: int,
                        settings: LossSpec, version: int) -> list[tuple[torch.Tensor, tuple[float, float]]]:
        """Each micro-batch's proximal logprobs and the (loss tokens, sequences) rollout rejection keeps of it,
        before any backward: the batch's totals must leave the rejected ones out. The micro-steps then take
        these logprobs as their proximal policy (no pass of their own); ``idle`` empty passes follow, as on
        ranks that run more micro-batches."""
        out = []
        for idx in plan:
            micro = pack([records[i] for i in idx]).to(self.backend.device)
            proximal = self.logprobs_no_grad(micro)
            keep = correct(proximal, micro.behavior_logp, micro.mask, settings.rollout_correction).keep
            out.append((proximal, kept_counts(keep, fresh_tokens(micro, settings, version))))
        for _ in range(idle):
            self.logprobs_no_grad(empty_batch(self.backend.device))
        return out

    @torch.no_grad()
    def _forward_step(self, batch: PackedBatch, settings: LossSpec, totals: BatchTotals, version: int,
                      seen: list[torch.Tensor], proximal: torch.Tensor | None = None) -> dict[str, float]:
        """`_micro_step`'s loss and metrics without gradient; the policy is its own proximal policy (or the
        rejection pass's ``proximal``, the same policy's)."""
        fresh = fresh_tokens(batch, settings, version)
        shares = self._shares(batch, settings, totals, fresh, proximal)
        ref = self.logprobs_no_grad(batch, reference=True) if settings.kl_coef else None
        self.backend.set_training(False)
        logp, entropy = self.backend.completion_logprobs(batch)
        seen.append(logp)
        if proximal is None and self._decoupled(settings):
            proximal = logp
        inputs = LossInputs(logp=logp, mask=batch.mask, advantages=batch.advantages, behavior_logp=batch.behavior_logp,
                            proximal_logp=proximal, ref_logp=ref, entropy=entropy, fresh=fresh,
                            token_advantages=batch.token_advantages, current=batch.token_versions == version,
                            teacher_logp=batch.teacher_logp)
        _, m = policy_loss(inputs, settings, norm_tokens=totals.norm_tokens)
        return self._weighted(m, shares)

    def _micro_step(self, batch: PackedBatch, settings: LossSpec, totals: BatchTotals, version: int,
                    seen: list[torch.Tensor] | None = None, proximal: torch.Tensor | None = None) -> dict[str, float]:
        """Forward + backward of one micro-batch, its loss scaled by its share of the whole batch; the
        with-grad pass's logprobs (detached) appended to ``seen``. ``proximal``: the rejection pass's."""
        fresh = fresh_tokens(batch, settings, version)
        shares = self._shares(batch, settings, totals, fresh, proximal)
        # Decoupled PPO's proximal policy is the policy before this update: with no dropout anywhere the
        # with-grad forward below computes exactly its logprobs, so they are read off it (detached)
        # instead of costing a forward pass of their own.
        separate_proximal = proximal is None and self.needs_proximal_pass(settings)
        reuse_proximal = proximal is None and self._decoupled(settings) and not separate_proximal
        if separate_proximal:
            proximal = self.logprobs_no_grad(batch)
        ref = self.logprobs_no_grad(batch, reference=True) if settings.kl_coef else None

        def scaled_loss(logp: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            if seen is not None:
                seen.append(logp.detach())
            inputs = LossInputs(logp=logp, mask=batch.mask, advantages=batch.advantages,
                                behavior_logp=batch.behavior_logp,
                                proximal_logp=logp.detach() if reuse_proximal else proximal, ref_logp=ref,
                                entropy=entropy, fresh=fresh, token_advantages=batch.token_advantages,
                                current=batch.token_versions == version, teacher_logp=batch.teacher_logp)
            loss, metrics = policy_loss(inputs, settings, norm_tokens=totals.norm_tokens)
            return loss * shares.loss, metrics

        self.backend.set_training(True)
        self.backend.before_micro_batch(batch)
        m = self.backend.loss_backward(batch, bool(settings.entropy_coef), scaled_loss)
        self.backend.set_training(False)
        return self._weighted(m, shares)

    def _idle_micro_step(self, settings: LossSpec, proximal_given: bool = False) -> None:
        """`_micro_step`'s forward and backward passes on a batch of no sequences, with a zero loss
        (``proximal_given``: the rejection pass ran the proximal ones)."""
        empty = empty_batch(self.backend.device)
        if self.needs_proximal_pass(settings) and not proximal_given:
            self.logprobs_no_grad(empty)
        if settings.kl_coef:
            self.logprobs_no_grad(empty, reference=True)
        self.backend.set_training(True)
        self.backend.loss_backward(empty, bool(settings.entropy_coef), lambda logp, entropy: (logp.sum() * 0.0, {}))
        self.backend.set_training(False)
