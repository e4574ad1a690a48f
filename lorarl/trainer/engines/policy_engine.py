"""The model-agnostic half of a LoRA RL engine: optimiser, schedule, version and checkpoints.

Every engine (transformers, Megatron) is a `ModelBackend` (lorarl.trainer.rl.step) for the one RL
step: it says how to compute completion logprobs, switch adapters off for the reference policy and
run a with-grad pass; `RLStep` owns the algorithm (advantages, loss shares, proximal and reference
passes, the staleness rule). The ranks of a parallel engine combine their parts through a
`GradientReducer` given at construction (none, torch data parallel, Megatron). What stays here is
what every engine does alike after the step: clip, AdamW, the schedule, the version, checkpoints.
"""

from __future__ import annotations

import abc
import contextlib
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lorarl.contract import versions
from lorarl.platform import torch_device
from lorarl.trainer.engines import checkpoint as ckpt
from lorarl.trainer.engines.api import (
    AdamStep,
    CheckpointInfo,
    Metrics,
    OptimizerSpec,
    TrainEngine,
    TrainingSpec,
    TrajectoryRecord,
)
from lorarl.trainer.engines.memory import free_device_bytes, needs_checkpointing
from lorarl.trainer.engines.recompute import (
    activation_checkpointing_enabled,
    disable_activation_checkpointing,
    enable_activation_checkpointing,
)
from lorarl.trainer.rl.batching import PackedBatch
from lorarl.trainer.rl.losses import LossSpec
from lorarl.trainer.rl.step import (
    EngineStateError,
    GradientReducer,
    LocalReducer,
    LossFn,
    RLStep,
)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENTROPY_CHUNK_ROWS = 256


def device_for(name: str) -> torch.device:
    """The torch device for ``name`` (lorarl.platform loads torch_npu first for Ascend).

    The NPU path (``npu``, ``npu:N``) exists for Ascend deployments and is untested in this
    repository: CI has no Ascend card.
    """
    return torch_device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def scheduled_lr(settings: OptimizerSpec, step: int) -> float:
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


class PolicyEngine(TrainEngine):
    """A TrainEngine minus the model, and the `ModelBackend` of its RL step: subclasses build the model and
    trainable parameters, then call `_init_training`, and implement `completion_logprobs`, `adapters_off`
    and `set_training` (pipelined models also `loss_backward`).

    Not thread-safe: the caller (the servicer) runs one call per engine at a time.
    """

    spec: TrainingSpec
    device: torch.device
    optimizer: torch.optim.Optimizer
    rl: RLStep
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
        self._apply_memory_mode()

    def _apply_memory_mode(self) -> None:
        """'on' / 'off' set on the layers ('auto' decides per micro-batch): again whenever this job takes its
        turn on a base other jobs share, since the mode lives on the shared layers."""
        if not hasattr(self, "_layered"):
            return
        mode = self.spec.memory.activation_checkpointing
        if mode != "auto" and (mode == "on") != activation_checkpointing_enabled(self._layered):
            (enable_activation_checkpointing if mode == "on" else disable_activation_checkpointing)(self._layered)

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the decoder layers recompute their activations now ("auto" decides per micro-batch)."""
        return activation_checkpointing_enabled(self._layered)

    def model_devices(self) -> list[torch.device]:
        """Every device holding part of the model: ``device``, or several under a layer split."""
        return [self.device]

    def _init_training(self, named_trainable: dict[str, nn.Parameter], reducer: GradientReducer | None = None
                       ) -> None:
        """AdamW over ``named_trainable``, fresh counters, and the RL step over this engine and ``reducer``
        (None: one process). Call once the parameters exist."""
        self._named_trainable = named_trainable
        self._trainable = list(named_trainable.values())
        opt = self.spec.optimizer
        self.optimizer = torch.optim.AdamW(self._trainable, lr=scheduled_lr(opt, 0), betas=opt.betas, eps=opt.eps,
                                           weight_decay=opt.weight_decay)
        self.rl = RLStep(self, reducer or LocalReducer(), micro_batch_tokens=opt.micro_batch_tokens,
                         decoupled=self.spec.decoupled, has_reference=not self.spec.full_finetune)
        self._step = 0
        self._version = 0
        self._pending_grads = False

    # ------------------------------------------------------------ the ModelBackend a model-specific engine completes

    @abc.abstractmethod
    def completion_logprobs(self, batch: PackedBatch, entropy_grad: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [B, T] of the completion tokens and the entropy [B, T] at each of them."""

    @abc.abstractmethod
    def adapters_off(self) -> contextlib.AbstractContextManager[None]:
        """Every adapter switched off: the reference policy."""

    @abc.abstractmethod
    def set_training(self, training: bool) -> None:
        """train() / eval() on the model (dropout on only while computing the loss)."""

    def loss_backward(self, batch: PackedBatch, entropy_grad: bool, loss_fn: LossFn) -> dict[str, float]:
        """Forward with grad, ``loss_fn(logp, entropy)``, backward; its metrics. Pipelined models override
        it: their loss exists on the last stage only and the backward runs through the stages."""
        logp, entropy = self.completion_logprobs(batch, entropy_grad=entropy_grad)
        loss, metrics = loss_fn(logp, entropy)
        loss.backward()
        return metrics

    def before_micro_batch(self, batch: PackedBatch) -> None:
        """"auto": checkpoint this micro-batch's layers when its plain activations would crowd the device
        (lorarl.trainer.engines.memory.needs_checkpointing, the rule the --dry-run plan applies too)."""
        if self.spec.memory.activation_checkpointing != "auto" or self.spec.full_finetune:
            return
        need = needs_checkpointing(self._shape, self.spec.lora.rank, self.spec.dtype, batch.input_ids.numel(),
                                   self.spec.memory.logits_chunk_tokens,
                                   min(free_device_bytes(d) for d in self.model_devices()),
                                   layers=self._local_layers, frozen_head=self.closed_form_head)
        if need != activation_checkpointing_enabled(self._layered):
            (enable_activation_checkpointing if need else disable_activation_checkpointing)(self._layered)

    def dropout_free(self) -> bool:
        """Whether a training-mode forward equals an eval-mode one: no LoRA dropout, no model dropout."""
        if self.spec.lora.dropout:
            return False
        config = getattr(getattr(self, "model", None), "config", None)
        return not any(getattr(config, name, 0.0) for name in ("attention_dropout", "hidden_dropout", "dropout"))

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

    @property
    def job_bytes(self) -> int:
        """Bytes this job holds between steps: its trained parameters, their gradients and optimizer moments."""
        tensors = [*self._trainable, *(p.grad for p in self._trainable if p.grad is not None),
                   *(t for state in self.optimizer.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _clip_gradients(self, max_norm: float) -> float:
        """The global gradient norm, after scaling gradients down to ``max_norm`` (inf: no clipping)."""
        return float(torch.nn.utils.clip_grad_norm_(self._trainable, max_norm))

    # ------------------------------------------------------------ training

    def forward_backward(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        """Accumulates gradients through the RL step (lorarl.trainer.rl.step: its metrics)."""
        self.routing_metrics([])  # forgets the passes before this step (a compute_logprobs, a warm-up)
        metrics = self.rl.forward_backward(list(batch), loss or self.spec.loss, self._version)
        metrics.update(self.routing_metrics(batch))
        self._pending_grads = True
        return metrics

    def forward_with_logprobs(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None,
                              forward_only: bool = False) -> tuple[Metrics, list[list[float]]]:
        logprobs: list[list[float]] = []
        self.routing_metrics([])
        metrics = self.rl.forward_backward(list(batch), loss or self.spec.loss, self._version, logprobs,
                                           forward_only=forward_only)
        metrics.update(self.routing_metrics(batch))
        self._pending_grads = self._pending_grads or not forward_only
        return metrics, logprobs

    def routing_metrics(self, batch: Sequence[TrajectoryRecord]) -> Metrics:
        """Routing replay's figures for ``batch`` and the passes since the last call (engines that replay
        recorded MoE routes, R3); none here."""
        return {}

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
        accelerator = [] if self.device.type == "cpu" else sorted(
            {d.index or 0 for d in self.model_devices()})
        python_rng = random.getstate()
        try:
            with torch.random.fork_rng(devices=accelerator, device_type=self.device.type
                                       if accelerator else "cuda"):
                self.forward_backward(group)
        finally:
            random.setstate(python_rng)
            self.set_training(False)
            self.optimizer.zero_grad(set_to_none=True)
            self._pending_grads = False

    def optim_step(self, lr: float | None = None, adam: AdamStep | None = None) -> Metrics:
        """Clips, steps AdamW and bumps the version; a non-finite gradient skips the update instead. ``adam``: this
        step's betas, eps, weight decay and clipping where the caller sets them (the job's OptimizerSpec
        otherwise, every step: an override lasts one step)."""
        settings = adam.applied_to(self.spec.optimizer) if adam is not None else self.spec.optimizer
        if not self._pending_grads:
            raise EngineStateError("no accumulated gradients: call forward_backward before optim_step")
        start = time.perf_counter()
        # Parameters no token reached (e.g. an MoE expert nobody was routed to) get zero gradients,
        # so every rank, and a single process, steps exactly the same set of parameters.
        for p in self._trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.rl.reducer.sync_gradients(self._trainable)
        max_norm = settings.max_grad_norm
        grad_norm = self._clip_gradients(max_norm if max_norm > 0 else math.inf)
        value = lr if lr is not None and lr > 0 else scheduled_lr(self.spec.optimizer, self._step)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            for group in self.optimizer.param_groups:
                group.update(lr=value, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay)
            self.optimizer.step()
            self._step += 1
            self._version = versions.next_version(self._version)
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_grads = False
        return {"grad_norm": grad_norm, "lr": value, "skipped": float(skipped), "version": float(self._version),
                "step": float(self._step), "time_s": time.perf_counter() - start}

    def compute_logprobs(self, batch: Sequence[TrajectoryRecord], reference: bool = False) -> list[list[float]]:
        return self.rl.compute_logprobs(list(batch), reference)

    # ------------------------------------------------------------ checkpoints

    def _checkpoint_meta(self) -> ckpt.CheckpointMeta:
        return ckpt.CheckpointMeta(
            base_model_fingerprint=self._fingerprint,
            lora=None if self.spec.full_finetune else ckpt.lora_identity(self.spec.lora),
            loss=asdict(self.spec.loss), full_finetune=self.spec.full_finetune, dtype=self.spec.dtype,
            base_model_path=str(Path(self.spec.base_model_path).resolve()), engine=self.spec.engine,
            base_model_name=self.spec.base_model_name)

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

    def renumber(self, version: int) -> None:
        if version < self._version:
            raise ValueError(f"version {version} is below the current version {self._version}")
        self._version = version
