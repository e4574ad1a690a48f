"""The model-agnostic half of a LoRA RL engine: one training step, optimiser, schedule, checkpoints.

Every engine (transformers, Megatron) trains the same way and differs only in how it computes
completion logprobs, how it switches adapters off for the reference policy, how parameters are
named and laid out, and how it exports. `PolicyEngine` holds the shared step:

    advantages = group_advantages(shaped rewards)                 # whole batch, before splitting
    for micro in split(batch, micro_batch_tokens):
        proximal = logprobs(policy)          if decoupled PPO      # no_grad, before any update
        ref      = logprobs(adapters off)    if kl_coef > 0        # no second model copy
        logp, entropy = logprobs(policy)                           # with grad
        (policy_loss(...) * share(micro)).backward()               # share: tokens or sequences
    clip grad norm ; AdamW.step ; version += 1

``share`` makes the accumulated gradient equal to the gradient of the full-batch loss: token-mean
losses weigh a micro-batch by its share of loss tokens, per-sequence losses (GRPO's seq-mean,
Dr.GRPO's constant-normalised sums) by its share of sequences; Dr.GRPO's constant is
``loss.max_response_tokens`` when set, else the longest completion of the whole batch. Data-parallel
ranks reuse the same rule with global totals (the ``_reduce_*`` hooks).
"""

from __future__ import annotations

import abc
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lorarl.contract import staleness
from lorarl.trainer.engines import checkpoint as ckpt
from lorarl.trainer.engines.api import (
    CheckpointInfo,
    EngineStateError,
    JobSpec,
    Metrics,
    OptimizerSettings,
    TrainEngine,
    TrajectoryRecord,
)
from lorarl.trainer.engines.batching import PackedBatch, compute_advantages, micro_batches, pack
from lorarl.trainer.engines.memory import free_device_bytes, needs_checkpointing
from lorarl.trainer.engines.recompute import (
    activation_checkpointing_enabled,
    disable_activation_checkpointing,
    enable_activation_checkpointing,
)
from lorarl.trainer.rl.losses import AGGREGATION, LossInputs, LossSettings, policy_loss

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Metrics averaged over loss weight (the micro-batch's share of the loss) vs over its share of tokens.
LOSS_WEIGHTED = ("loss", "pg_loss", "kl", "entropy")
TOKEN_WEIGHTED = ("clip_fraction", "ratio_mean", "importance_weight_mean", "behavior_logprob_abs_diff")
ENTROPY_CHUNK_ROWS = 256
# (logp, entropy) of a micro-batch -> (its loss share to backpropagate, the loss metrics)
LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def device_for(name: str) -> torch.device:
    """The torch device for ``name``; imports torch_npu first for Ascend.

    The NPU path (``npu``, ``npu:N``) exists for Ascend deployments and is untested in this
    repository: CI has no Ascend card.
    """
    if name.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def scheduled_lr(settings: OptimizerSettings, step: int) -> float:
    """Linear warmup over warmup_steps, then cosine to 0 at total_steps (constant if total_steps unset)."""
    peak = settings.learning_rate
    if step < settings.warmup_steps:
        return peak * (step + 1) / settings.warmup_steps
    span = settings.total_steps - settings.warmup_steps
    if span <= 0:
        return peak
    progress = min(1.0, (step - settings.warmup_steps) / span)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` [B, T] under ``logits`` [B, T, V] and the entropy at each position.

    log_softmax runs in fp32 whatever the model dtype. Entropy carries gradient only when
    ``entropy_grad`` (entropy bonus in the loss); otherwise it is computed in row chunks, so no
    extra [tokens, vocab] temporaries exist at the peak.
    """
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        rows = logp_all.detach().flatten(0, -2).split(ENTROPY_CHUNK_ROWS)
        entropy = torch.cat([-(r.exp() * r).sum(-1) for r in rows]).view(logp.shape)
    return logp, entropy


def empty_batch(device: torch.device) -> PackedBatch:
    """A batch of no sequences (shapes [0, 1]): what an idle micro-step feeds the model."""
    ids = torch.zeros(0, 1, dtype=torch.long, device=device)
    zeros = torch.zeros(0, 1, device=device)
    return PackedBatch(input_ids=ids, attention_mask=ids, target_positions=ids, completion_ids=ids, mask=zeros,
                       behavior_logp=zeros, token_versions=ids, advantages=torch.zeros(0, device=device),
                       completion_lengths=torch.zeros(0, dtype=torch.long, device=device))


@dataclass
class BatchTotals:
    """Whole-batch counts every micro-batch's loss share is measured against (global under DP)."""

    sequences: float
    tokens: float  # completion tokens
    loss_tokens: float  # completion tokens that count in the loss (not masked as stale)
    norm_tokens: int  # Dr.GRPO's constant length normaliser


def loss_mask(batch: PackedBatch, settings: LossSettings, version: int) -> torch.Tensor:
    """The completion mask after staleness masking, exactly as policy_loss applies it."""
    if settings.max_staleness is None:
        return batch.mask
    return batch.mask * staleness.fresh(version, batch.token_versions, settings.max_staleness).float()


class PolicyEngine(TrainEngine):
    """A TrainEngine minus the model: subclasses build the model and trainable parameters, then call
    `_init_training`, and implement `_completion_logprobs`, `_adapters_off` and `_set_training`.

    Not thread-safe: the caller (the servicer) runs one call per engine at a time.
    """

    spec: JobSpec
    device: torch.device
    optimizer: torch.optim.Optimizer
    _fingerprint: str
    _named_trainable: dict[str, nn.Parameter]
    _trainable: list[nn.Parameter]
    #: Whether a frozen LM head's gradient is taken in closed form (lorarl.trainer.engines.head_logprobs), which
    #: the memory rule must know: it keeps no [tokens, vocab] tensor for backward.
    closed_form_head: bool = False

    def _init_memory(self, layered: nn.Module, shape: dict[str, Any], local_layers: int) -> None:
        """Where activation checkpointing applies: ``layered``'s decoder layers (``local_layers`` of the
        model's, on this rank), sized by ``shape`` (config.json fields); "on" takes effect now."""
        self._layered, self._shape, self._local_layers = layered, shape, local_layers
        if self.spec.memory.activation_checkpointing == "on":
            enable_activation_checkpointing(layered)

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the decoder layers recompute their activations now ("auto" decides per micro-batch)."""
        return activation_checkpointing_enabled(self._layered)

    def _choose_checkpointing(self, batch: PackedBatch) -> None:
        """"auto": checkpoint this micro-batch's layers when its plain activations would crowd the device
        (lorarl.trainer.engines.memory.needs_checkpointing, the rule the --dry-run plan applies too)."""
        if self.spec.memory.activation_checkpointing != "auto" or self.spec.full_finetune:
            return
        need = needs_checkpointing(self._shape, self.spec.lora.rank, self.spec.dtype, batch.input_ids.numel(),
                                   self.spec.memory.logits_chunk_tokens, free_device_bytes(self.device),
                                   layers=self._local_layers, frozen_head=self.closed_form_head)
        if need != activation_checkpointing_enabled(self._layered):
            (enable_activation_checkpointing if need else disable_activation_checkpointing)(self._layered)

    def _init_training(self, named_trainable: dict[str, nn.Parameter]) -> None:
        """AdamW over ``named_trainable`` and fresh counters (call once the parameters exist)."""
        self._named_trainable = named_trainable
        self._trainable = list(named_trainable.values())
        opt = self.spec.optimizer
        self.optimizer = torch.optim.AdamW(self._trainable, lr=scheduled_lr(opt, 0), betas=opt.betas, eps=opt.eps,
                                           weight_decay=opt.weight_decay)
        self._step = 0
        self._version = 0
        self._pending_grads = False

    # ------------------------------------------------------------ what a model-specific engine provides

    @abc.abstractmethod
    def _completion_logprobs(self, batch: PackedBatch, entropy_grad: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [B, T] of the completion tokens and the entropy [B, T] at each of them."""

    @abc.abstractmethod
    def _adapters_off(self) -> contextlib.AbstractContextManager[None]:
        """Every adapter switched off: the reference policy."""

    @abc.abstractmethod
    def _set_training(self, training: bool) -> None:
        """train() / eval() on the model (dropout on only while computing the loss)."""

    # ------------------------------------------------------------ properties

    @property
    def version(self) -> int:
        return self._version

    @property
    def step(self) -> int:
        return self._step

    @property
    def base_model_fingerprint(self) -> str:
        return self._fingerprint

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self._trainable)

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self._named_trainable)

    # ------------------------------------------------------------ parallel hooks (no-ops on one process)

    def _reduce_totals(self, totals: BatchTotals) -> BatchTotals:
        return totals

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def _sync_gradients(self) -> None:
        return None

    def _loss_backward(self, batch: PackedBatch, entropy_grad: bool, loss_fn: LossFn) -> dict[str, float]:
        """Forward with grad, ``loss_fn(logp, entropy)``, backward; its metrics. Pipelined models override
        it: their loss exists on the last stage only and the backward runs through the stages."""
        logp, entropy = self._completion_logprobs(batch, entropy_grad=entropy_grad)
        loss, metrics = loss_fn(logp, entropy)
        loss.backward()
        return metrics

    def _idle_micro_steps(self, planned: int) -> int:
        """How many idle micro-steps (`_idle_micro_step`) follow this rank's ``planned`` ones; asked before
        any runs. Engines whose forward passes are collectives across data-parallel ranks (expert
        parallelism) answer what makes every rank run as many."""
        return 0

    def _idle_micro_step(self, settings: LossSettings) -> None:
        """`_micro_step`'s forward and backward passes on a batch of no sequences, with a zero loss."""
        empty = empty_batch(self.device)
        if self._needs_proximal_pass(settings):
            self._logprobs_no_grad(empty)
        if settings.kl_coef:
            self._logprobs_no_grad(empty, reference=True)
        self._set_training(True)
        self._loss_backward(empty, bool(settings.entropy_coef), lambda logp, entropy: (logp.sum() * 0.0, {}))
        self._set_training(False)

    def _clip_gradients(self, max_norm: float) -> float:
        """The global gradient norm, after scaling gradients down to ``max_norm`` (inf: no clipping)."""
        return float(torch.nn.utils.clip_grad_norm_(self._trainable, max_norm))

    # ------------------------------------------------------------ training

    def _totals(self, records: Sequence[TrajectoryRecord], settings: LossSettings) -> BatchTotals:
        tokens = sum(len(r.completion_token_ids) for r in records)
        loss_tokens = tokens
        if settings.max_staleness is not None:
            loss_tokens = sum(1 for r in records for v in r.token_versions
                              if staleness.fresh(self._version, v, settings.max_staleness))
        norm = settings.max_response_tokens or max((len(r.completion_token_ids) for r in records), default=0)
        return BatchTotals(float(len(records)), float(tokens), float(loss_tokens), int(norm))

    @torch.no_grad()
    def _logprobs_no_grad(self, batch: PackedBatch, reference: bool = False) -> torch.Tensor:
        self._set_training(False)
        if reference:
            if self.spec.full_finetune:
                raise EngineStateError("reference logprobs need adapters; a full fine-tune has no frozen reference")
            with self._adapters_off():
                return self._completion_logprobs(batch)[0]
        return self._completion_logprobs(batch)[0]

    def _dropout_free(self) -> bool:
        """Whether a training-mode forward equals an eval-mode one: no LoRA dropout, no model dropout."""
        if self.spec.lora.dropout:
            return False
        config = getattr(getattr(self, "model", None), "config", None)
        return not any(getattr(config, name, 0.0) for name in ("attention_dropout", "hidden_dropout", "dropout"))

    def _needs_proximal_pass(self, settings: LossSettings) -> bool:
        """Whether decoupled PPO's proximal logprobs need a no-grad pass of their own (else they are read
        off the with-grad forward); `_micro_step` and `_idle_micro_step` must run the same passes."""
        return self.spec.decoupled(settings) and not self._dropout_free()

    def _micro_step(self, batch: PackedBatch, settings: LossSettings, totals: BatchTotals) -> dict[str, float]:
        """Forward + backward of one micro-batch, its loss scaled by its share of the whole batch."""
        mask = loss_mask(batch, settings, self._version)
        token_share = float(mask.sum()) / totals.loss_tokens if totals.loss_tokens else 0.0
        share = token_share if AGGREGATION[settings.name] == "token-mean" else batch.size / totals.sequences
        raw_token_share = float(batch.mask.sum()) / totals.tokens if totals.tokens else 0.0
        # Decoupled PPO's proximal policy is the policy before this update: with no dropout anywhere the
        # with-grad forward below computes exactly its logprobs, so they are read off it (detached)
        # instead of costing a forward pass of their own.
        reuse_proximal = self.spec.decoupled(settings) and not self._needs_proximal_pass(settings)
        proximal = self._logprobs_no_grad(batch) if self._needs_proximal_pass(settings) else None
        ref = self._logprobs_no_grad(batch, reference=True) if settings.kl_coef else None

        def scaled_loss(logp: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            inputs = LossInputs(logp=logp, mask=batch.mask, advantages=batch.advantages,
                                behavior_logp=batch.behavior_logp,
                                proximal_logp=logp.detach() if reuse_proximal else proximal, ref_logp=ref,
                                entropy=entropy, token_versions=batch.token_versions, current_version=self._version)
            loss, metrics = policy_loss(inputs, settings, norm_tokens=totals.norm_tokens)
            return loss * share, metrics

        self._set_training(True)
        self._choose_checkpointing(batch)
        m = self._loss_backward(batch, bool(settings.entropy_coef), scaled_loss)
        self._set_training(False)
        out = {k: m[k] * share for k in LOSS_WEIGHTED if k in m}
        out.update({k: m[k] * token_share for k in TOKEN_WEIGHTED})
        out["stale_token_fraction"] = m["stale_token_fraction"] * raw_token_share
        return out

    def forward_backward(self, batch: Sequence[TrajectoryRecord], loss: LossSettings | None = None) -> Metrics:
        """Accumulates gradients; metrics are full-batch values: loss, pg_loss, entropy, clip_fraction,
        ratio_mean, importance_weight_mean, stale_token_fraction, kl (only when kl_coef > 0, the only
        case the reference pass runs), tokens, loss_tokens, sequences, version, time_s."""
        start = time.perf_counter()
        records = list(batch)
        settings = loss or self.spec.loss
        if settings.kl_coef and self.spec.full_finetune:
            raise ValueError("loss.kl_coef must be 0 with full_finetune (no frozen reference policy)")
        totals = self._reduce_totals(self._totals(records, settings))
        if not totals.tokens:
            raise ValueError("trajectories must hold at least one completion token")
        advantages = compute_advantages(records, settings)
        # A fixed key set, so data-parallel ranks (even one with an empty shard) reduce alike.
        keys = [*LOSS_WEIGHTED, *TOKEN_WEIGHTED, "stale_token_fraction"]
        sums = {k: 0.0 for k in keys if k != "kl" or settings.kl_coef}
        plan = micro_batches([r.num_tokens for r in records], self.spec.optimizer.micro_batch_tokens)
        idle = self._idle_micro_steps(len(plan))
        for idx in plan:
            micro = pack([records[i] for i in idx], advantages[idx]).to(self.device)
            for key, value in self._micro_step(micro, settings, totals).items():
                sums[key] += value
        for _ in range(idle):
            self._idle_micro_step(settings)
        metrics = self._reduce_metrics(sums)
        self._pending_grads = True
        metrics.update(tokens=totals.tokens, loss_tokens=totals.loss_tokens, sequences=totals.sequences,
                       version=float(self._version), time_s=time.perf_counter() - start)
        return metrics

    def warm_up(self) -> None:
        """One forward and backward on a two-completion dummy group, its gradients and random draws
        discarded: the first real step then skips lazy imports and allocator/kernel set-up (~0.04 s on the
        demo model). Weights, optimiser state, version and RNG streams are left as they were, so every step
        computes what it would have without it."""
        if self._pending_grads:
            raise EngineStateError("warm_up with accumulated gradients would discard them")
        ids = [i % self.vocab_size for i in range(1, 8)]
        group = [TrajectoryRecord(ids[:3], ids[3:5], [-1.0] * 2, [self._version] * 2, 1.0, "warm-up"),
                 TrajectoryRecord(ids[:3], ids[4:7], [-1.0] * 3, [self._version] * 3, 0.0, "warm-up")]
        accelerator = [] if self.device.type == "cpu" else [self.device.index or 0]
        python_rng = random.getstate()
        try:
            with torch.random.fork_rng(devices=accelerator, device_type=self.device.type
                                       if accelerator else "cuda"):
                self.forward_backward(group)
        finally:
            random.setstate(python_rng)
            self._set_training(False)
            self.optimizer.zero_grad(set_to_none=True)
            self._pending_grads = False

    def optim_step(self, lr: float | None = None) -> Metrics:
        """Clips, steps AdamW and bumps the version; a non-finite gradient skips the update instead."""
        if not self._pending_grads:
            raise EngineStateError("no accumulated gradients: call forward_backward before optim_step")
        start = time.perf_counter()
        # Parameters no token reached (e.g. an MoE expert nobody was routed to) get zero gradients,
        # so every rank, and a single process, steps exactly the same set of parameters.
        for p in self._trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._sync_gradients()
        max_norm = self.spec.optimizer.max_grad_norm
        grad_norm = self._clip_gradients(max_norm if max_norm > 0 else math.inf)
        value = lr if lr is not None and lr > 0 else scheduled_lr(self.spec.optimizer, self._step)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = value
            self.optimizer.step()
            self._step += 1
            self._version += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_grads = False
        return {"grad_norm": grad_norm, "lr": value, "skipped": float(skipped), "version": float(self._version),
                "step": float(self._step), "time_s": time.perf_counter() - start}

    def compute_logprobs(self, batch: Sequence[TrajectoryRecord], reference: bool = False) -> list[list[float]]:
        records = list(batch)
        out: list[list[float]] = [[] for _ in records]
        for idx in micro_batches([r.num_tokens for r in records], self.spec.optimizer.micro_batch_tokens):
            micro = pack([records[i] for i in idx]).to(self.device)
            logp = self._logprobs_no_grad(micro, reference=reference).cpu()
            for row, i in enumerate(idx):
                out[i] = logp[row, : len(records[i].completion_token_ids)].tolist()
        return out

    # ------------------------------------------------------------ checkpoints

    def _checkpoint_meta(self) -> ckpt.CheckpointMeta:
        return ckpt.CheckpointMeta(
            base_model_fingerprint=self._fingerprint,
            lora=None if self.spec.full_finetune else ckpt.lora_identity(self.spec.lora),
            loss=asdict(self.spec.loss), full_finetune=self.spec.full_finetune, dtype=self.spec.dtype,
            base_model_path=str(Path(self.spec.base_model_path).resolve()), engine=self.spec.engine)

    def _training_state(self, data_cursor: Any) -> ckpt.TrainingState:
        """What a checkpoint holds; engines with sharded parameters override it to gather them."""
        rng_tensors, rng = ckpt.capture_rng(self.device)
        return ckpt.TrainingState(step=self._step, version=self._version, params=self._named_trainable,
                                  optimizer=self.optimizer.state_dict(), param_names=list(self._named_trainable),
                                  rng_tensors=rng_tensors, rng=rng, data_cursor=data_cursor)

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter shapes as a checkpoint stores them (full shapes for sharded parameters)."""
        return {n: tuple(p.shape) for n, p in self._named_trainable.items()}

    def _restore_training_state(self, state: ckpt.TrainingState) -> None:
        """Copies parameters and optimiser state in; engines with sharded parameters take their shard."""
        with torch.no_grad():
            for name, param in self._named_trainable.items():
                param.copy_(state.params[name])
        self.optimizer.load_state_dict(state.optimizer)

    def _checkpoint_param_names(self) -> list[str]:
        """The optimiser's parameter order as a checkpoint stores it (every rank's, when sharded)."""
        return list(self._named_trainable)

    def _writes_checkpoint(self) -> bool:
        """Whether this process writes the checkpoint files (rank 0 of a multi-process engine)."""
        return True

    def save_checkpoint(self, path: str | Path, data_cursor: Any = None) -> CheckpointInfo:
        state = self._training_state(data_cursor)
        final = Path(path)
        if self._writes_checkpoint():
            final = ckpt.save_checkpoint(path, self._checkpoint_meta(), state)
        return CheckpointInfo(final, self._step, self._version, data_cursor)

    def load_checkpoint(self, path: str | Path) -> CheckpointInfo:
        state = ckpt.load_checkpoint(path, self._checkpoint_meta(), self._checkpoint_shapes())
        if state.param_names != self._checkpoint_param_names():
            raise ckpt.CheckpointMismatchError(f"checkpoint {path} orders its optimiser parameters differently")
        self._restore_training_state(state)
        ckpt.restore_rng(state.rng_tensors, state.rng)
        self._step, self._version = state.step, state.version
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_grads = False
        return CheckpointInfo(Path(path), state.step, state.version, state.data_cursor)
