"""What every trainer engine offers (torch, Megatron), and the plain data it works on.

The gRPC servicer only ever talks to a `TrainEngine`, so engines are swappable and testable without
a server. Everything here is plain Python, no protobuf in the engines' signatures. The settings an engine
is built by are the training spec (lorarl.contract.training), whose classes validate themselves and name
the offending field (SpecError: ``optimizer.learning_rate``), which the servicer maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The training spec engines are built by (lorarl.contract.training), re-exported: what engines take.
from lorarl.contract.training import (  # noqa: F401
    DTYPES,
    ENGINES,
    AdamStep,
    LimitsSpec,
    LossSpec,
    MegatronSpec,
    MemorySpec,
    OptimizerSpec,
    TrainingSpec,
)
from lorarl.trainer.rl.step import EngineStateError  # noqa: F401  (re-exported: what engines raise)
from lorarl.trainer.rl.trajectory import TrajectoryRecord  # re-exported: what engines take

if TYPE_CHECKING:
    import torch

Metrics = dict[str, float]
FINISH_REASONS = ("", "stop", "length", "abort")


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a checkpoint is and what it holds; ``data_cursor`` is the caller's opaque JSON value."""

    path: Path
    step: int
    version: int
    data_cursor: Any = None


class TrainEngine(abc.ABC):
    """A policy being trained: frozen base + trainable adapters, an optimiser, a version counter.

    ``version`` is the policy version: 0 for the untrained adapter, +1 per optimiser step.
    ``forward_backward`` may be called several times before ``optim_step``; gradients add up.
    """

    spec: TrainingSpec

    @classmethod
    @abc.abstractmethod
    def create(cls, spec: TrainingSpec) -> TrainEngine: ...

    @abc.abstractmethod
    def forward_backward(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        """Accumulates gradients of the policy loss on ``batch`` (advantages from the whole batch)."""

    def forward_with_logprobs(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None,
                              forward_only: bool = False) -> tuple[Metrics, list[list[float]]]:
        """forward_backward (or, ``forward_only``, its loss without gradient) that also returns each record's
        completion-token logprobs from the same pass: the Tinker API's forward / forward_backward. An engine
        that cannot (its ranks split the batch or the pipeline) says so."""
        raise NotImplementedError(f"the {type(self).__name__} engine does not return logprobs from a training pass "
                                  "(forward_only / return_logprobs); use the torch engine on one rank")

    @abc.abstractmethod
    def optim_step(self, lr: float | None = None, adam: AdamStep | None = None) -> Metrics:
        """Applies accumulated gradients (``lr`` overrides the schedule for this step, ``adam`` the job's betas,
        eps, weight decay and clipping for this step); bumps version."""

    def warm_up(self) -> None:  # noqa: B027 (an optional hook, not an abstract method)
        """Pays one-time costs before the first step; changes nothing a step computes. A no-op here."""

    def train_step(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        """One full update: forward_backward on the batch, then optim_step."""
        start = time.perf_counter()
        metrics = dict(self.forward_backward(batch, loss))
        metrics.update(self.optim_step())
        metrics["time_s"] = time.perf_counter() - start
        return metrics

    @abc.abstractmethod
    def compute_logprobs(self, batch: Sequence[TrajectoryRecord], reference: bool = False) -> list[list[float]]:
        """Per completion token logprobs under the current policy, or the reference (adapters off)."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str | Path, data_cursor: Any = None) -> CheckpointInfo: ...

    @abc.abstractmethod
    def load_checkpoint(self, path: str | Path) -> CheckpointInfo: ...

    @abc.abstractmethod
    def renumber(self, version: int) -> None:
        """Moves the version counter up to ``version`` (weights unchanged): a resumed job continues above
        every number weight sync already holds, so one number never names two sets of weights."""

    @abc.abstractmethod
    def export_adapter(self, path: str | Path) -> Path:
        """The adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors)."""

    @abc.abstractmethod
    def export_merged(self, path: str | Path) -> Path:
        """The merged policy as a Hugging Face model directory."""

    @abc.abstractmethod
    def iter_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Adapter tensors in PEFT names."""

    @abc.abstractmethod
    def iter_merged_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every merged weight in HF names, streamed layer by layer."""

    @abc.abstractmethod
    def iter_base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every frozen base weight in HF names (the catalog weight sync checks payloads against)."""

    def close(self) -> None:  # noqa: B027 (optional hook: most engines hold nothing beyond their memory)
        """Releases what the engine holds on job deletion (a multi-rank engine frees it on every rank)."""

    @property
    @abc.abstractmethod
    def version(self) -> int: ...

    @property
    @abc.abstractmethod
    def step(self) -> int: ...

    @property
    @abc.abstractmethod
    def base_model_fingerprint(self) -> str: ...

    @property
    @abc.abstractmethod
    def trainable_parameters(self) -> int: ...

    @property
    @abc.abstractmethod
    def total_parameters(self) -> int: ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    def memory(self) -> tuple[int, int, int]:
        """(base bytes, jobs sharing that base, this job's own bytes); 0s where an engine does not count."""
        return (0, 1, 0)
