"""What every trainer engine offers (torch, Megatron), and the plain data it works on.

The gRPC servicer only ever talks to a `TrainEngine`, so engines are swappable and testable without
a server. Everything here is plain Python, no protobuf (torch comes in through the LoRA and loss
settings, so a fast-starting server imports this module lazily). Every settings class validates
itself and names the offending field with its dotted path (``optimizer.learning_rate``), so the
servicer can map the ValueError to INVALID_ARGUMENT.
"""

from __future__ import annotations

import abc
import math
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.rl.losses import LossSettings
from lorarl.trainer.rl.step import EngineStateError  # noqa: F401  (re-exported: what engines raise)
from lorarl.trainer.rl.trajectory import TrajectoryRecord  # re-exported: what engines take

if TYPE_CHECKING:
    import torch

Metrics = dict[str, float]
DTYPES = ("float32", "bfloat16")
ENGINES = ("torch", "megatron")
FINISH_REASONS = ("", "stop", "length", "abort")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|npu(:\d+)?")


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and schedule knobs; mirrors lorarl.v1.OptimizerConfig.

    Schedule: linear warmup over ``warmup_steps``, then cosine decay to 0 at ``total_steps`` when
    ``total_steps > warmup_steps``, constant otherwise (RL jobs often run open-ended).
    ``micro_batch_tokens`` caps the summed sequence length of a micro-batch; 0 means one micro-batch.
    ``max_grad_norm`` 0 disables clipping (the norm is still reported).
    """

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    total_steps: int = 0
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "weight_decay", "beta1", "beta2", "eps", "max_grad_norm"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"optimizer.{name} must be a finite number, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ValueError(f"optimizer.learning_rate must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps must be > 0, got {self.eps}")
        for name in ("warmup_steps", "total_steps", "micro_batch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"optimizer.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_grad_norm < 0:
            raise ValueError(f"optimizer.max_grad_norm must be >= 0 (0 disables), got {self.max_grad_norm}")

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)


@dataclass(frozen=True)
class Limits:
    """Bounds on what a job accepts, so one client cannot exhaust the trainer's memory."""

    max_sequence_tokens: int = 4096
    max_buffered_trajectories: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_sequence_tokens", "max_buffered_trajectories"):
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class MegatronSettings:
    """Model-parallel sizes for ``engine="megatron"``; mirrors lorarl.v1.MegatronConfig.

    The job's world size (torch.distributed ranks) divided by tp * pp is the data-parallel size.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"megatron.{name} must be >= 1, got {getattr(self, name)}")


CHECKPOINTING = ("auto", "on", "off")


@dataclass(frozen=True)
class MemorySettings:
    """How the engine trades compute for memory; mirrors lorarl.v1.MemoryConfig.

    ``activation_checkpointing``: "on" recomputes each decoder layer's activations in backward, "off"
    keeps them, "auto" turns it on when a full micro-batch's activations would not fit the device
    (lorarl.trainer.engines.memory). ``logits_chunk_tokens``: rows of one LM-head/log-softmax chunk (0:
    the whole micro-batch at once).
    """

    activation_checkpointing: str = "auto"
    logits_chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"memory.activation_checkpointing must be one of {list(CHECKPOINTING)}, "
                             f"got {self.activation_checkpointing!r}")
        if self.logits_chunk_tokens < 0:
            raise ValueError(f"memory.logits_chunk_tokens must be >= 0 (0: no chunks), got {self.logits_chunk_tokens}")


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to build an engine; mirrors lorarl.v1.JobConfig.

    ``seed`` is the job's only seed: it seeds adapter initialisation (overriding ``lora.seed``),
    the torch/python RNGs and therefore LoRA dropout. ``recompute_proximal`` forces decoupled PPO
    (proximal logprobs recomputed before the step); it is also on whenever
    ``loss.behavior_weight_cap > 0`` or ``loss.max_staleness`` is set. ``megatron`` holds the
    model-parallel sizes of the Megatron engine (defaults for every other engine). ``layer_devices``
    splits the torch engine's decoder layers across that many devices of its one process
    (lorarl.trainer.engines.layer_split). ``init_adapter_path``: a PEFT adapter the adapters start from
    (version 1 then; 0 stays the base model).
    """

    base_model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    lora: LoraConfig = field(default_factory=LoraConfig)
    loss: LossSettings = field(default_factory=LossSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    full_finetune: bool = False
    seed: int = 0
    engine: str = "torch"
    limits: Limits = field(default_factory=Limits)
    recompute_proximal: bool = False
    megatron: MegatronSettings = field(default_factory=MegatronSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    layer_devices: int = 1
    init_adapter_path: str = ""

    def __post_init__(self) -> None:
        if not self.base_model_path:
            raise ValueError("base_model_path must be set")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must look like 'cpu', 'cuda', 'cuda:1' or 'npu', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.engine == "megatron" and self.device.startswith("npu"):
            raise ValueError("engine 'megatron' cannot run on Ascend NPUs: megatron-core needs MindSpeed (Ascend's "
                             "adaptation of it) there, which lorarl does not ship; use engine 'torch' on device 'npu'")
        if self.engine != "megatron" and self.megatron != MegatronSettings():
            raise ValueError(f"megatron.* settings apply to engine 'megatron' only, not {self.engine!r}")
        if not 1 <= self.layer_devices <= 64:
            raise ValueError(f"layer_devices must be 1..64, got {self.layer_devices}")
        if self.layer_devices > 1 and self.engine != "torch":
            raise ValueError(f"layer_devices splits the torch engine's layers; engine {self.engine!r} has "
                             "megatron.pipeline_parallel_size for that")
        if self.init_adapter_path and (self.engine != "torch" or self.full_finetune):
            raise ValueError("init_adapter_path (a warm start from a PEFT adapter) needs engine 'torch' and adapters "
                             f"(engine {self.engine!r}, full_finetune {self.full_finetune})")
        if self.full_finetune and self.loss.kl_coef:
            raise ValueError("loss.kl_coef must be 0 with full_finetune (the reference is the base with adapters off)")

    def decoupled(self, loss: LossSettings | None = None) -> bool:
        """Whether proximal logprobs must be recomputed before the step (decoupled PPO)."""
        loss = loss or self.loss
        return self.recompute_proximal or loss.behavior_weight_cap > 0 or loss.max_staleness is not None


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

    spec: JobSpec

    @classmethod
    @abc.abstractmethod
    def create(cls, spec: JobSpec) -> TrainEngine: ...

    @abc.abstractmethod
    def forward_backward(self, batch: Sequence[TrajectoryRecord], loss: LossSettings | None = None) -> Metrics:
        """Accumulates gradients of the policy loss on ``batch`` (advantages from the whole batch)."""

    @abc.abstractmethod
    def optim_step(self, lr: float | None = None) -> Metrics:
        """Applies accumulated gradients (``lr`` overrides the schedule for this step); bumps version."""

    def warm_up(self) -> None:  # noqa: B027 (an optional hook, not an abstract method)
        """Pays one-time costs before the first step; changes nothing a step computes. A no-op here."""

    def train_step(self, batch: Sequence[TrajectoryRecord], loss: LossSettings | None = None) -> Metrics:
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
