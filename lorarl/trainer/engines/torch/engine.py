"""The trainer engine in plain PyTorch: a frozen transformers Qwen3 / Qwen3-MoE base plus LoRA adapters.

The RL step (advantages, micro-batches, loss shares: lorarl.trainer.rl.step) and the optimiser side
(AdamW, schedule, checkpoints: lorarl.trainer.engines.policy_engine) are model-agnostic; this module
is the step's model backend for a transformers model: completion logprobs, adapters off, export.

Creating an engine seeds the process-global torch/python RNGs from ``spec.seed`` (LoRA dropout
draws from them).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lorarl.contract import versions
from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.contract.peft import read_peft_tensors
from lorarl.trainer.engines.api import (
    AdamStep,
    CheckpointInfo,
    EngineStateError,
    LossSpec,
    Metrics,
    TrainingSpec,
    TrajectoryRecord,
)
from lorarl.trainer.engines.export import save_merged_model, save_peft_adapter
from lorarl.trainer.engines.head_logprobs import head_token_logprobs
from lorarl.trainer.engines.policy_engine import (  # noqa: F401  (re-exported: the torch engine's public names)
    ENTROPY_CHUNK_ROWS,
    TORCH_DTYPES,
    PolicyEngine,
    device_for,
    scheduled_lr,
    seed_everything,
    token_logprobs,
)
from lorarl.trainer.engines.recompute import DEFAULT_LOGITS_CHUNK_TOKENS
from lorarl.trainer.engines.torch import routing_replay
from lorarl.trainer.engines.torch.layer_split import place_by_layers, split_devices
from lorarl.trainer.engines.torch.prefix_sharing import (
    attention_cost,
    plan_prefix_sharing,
    shared_prefix_hidden,
    supports_prefix_sharing,
)
from lorarl.trainer.engines.torch.shared_base import BaseKey, BaseRegistry, RngState, SharedBase, alias_base
from lorarl.trainer.rl import routing
from lorarl.trainer.rl.batching import PackedBatch
from lorarl.trainer.rl.lora import (
    AdapterSlot,
    adapters_disabled,
    attach_lora,
    iter_merged_weights,
    load_peft_state_dict,
    peft_state_dict,
)
from lorarl.trainer.rl.step import GradientReducer

logger = logging.getLogger(__name__)


def completion_logprobs(model: nn.Module, batch: PackedBatch, entropy_grad: bool = False,
                        share_prompts: bool = True, pack_completions: bool = True,
                        logits_chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [B, T] of the completion tokens and the policy entropy [B, T] at each of them.

    Runs the decoder, then the LM head only at the positions predicting completion tokens (the
    prompt's logits are never built), ``logits_chunk_tokens`` rows at a time (lorarl.trainer.engines.head_logprobs).
    Rows repeating a prompt (a GRPO group) share one forward of it when ``share_prompts``
    (lorarl.trainer.engines.torch.prefix_sharing; same numbers, less work), and their completions skip padding by
    packing when ``pack_completions`` and the layout estimate says it pays.
    """
    plan = None
    if share_prompts and supports_prefix_sharing(model):
        plan = plan_prefix_sharing(batch, attention_cost(model) if pack_completions else None)
    if plan is not None:
        selected = shared_prefix_hidden(model.get_decoder(), batch, plan)
    else:
        replay = routing_replay.plain_replay(batch)  # the rollout's experts, when the batch carries them (R3)
        hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                     use_cache=False, **({} if replay is None else {"routing_replay": replay})
                                     ).last_hidden_state
        selected = hidden.gather(1, batch.target_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return head_token_logprobs(selected, model.get_output_embeddings(), batch.completion_ids, entropy_grad,
                               token_logprobs, logits_chunk_tokens)


class TorchEngine(PolicyEngine):
    """TrainEngine with transformers + lorarl.trainer.rl.lora, on one device or, with ``spec.layer_devices``,
    its decoder layers split across several (lorarl.trainer.engines.torch.layer_split).

    ``share_prompts`` (default on) runs a repeated prompt once per micro-batch; off gives the plain forward.
    ``pack_completions`` (default on) lets that shared forward pack completions instead of padding them.
    """

    share_prompts: bool = True
    pack_completions: bool = True

    def __init__(self, spec: TrainingSpec, reducer: GradientReducer | None = None,
                 bases: BaseRegistry | None = None) -> None:
        """``reducer``: how ranks that share the step combine it (engines.distributed); None: one process.
        ``bases``: the trainer's resident bases (lorarl.trainer.engines.torch.shared_base): a job on one of them
        adds only its adapter; None, or a full fine-tune (which trains the base): a base of its own."""
        self.spec = spec
        self.device = device_for(spec.device)
        self.devices = split_devices(spec.device, spec.layer_devices)
        self._bases = bases if bases is not None and not spec.full_finetune else BaseRegistry()
        self.base, resident = self._bases.get_or_load(
            BaseKey.of(spec), lambda: self._load_base(spec, self.devices, self._bases.shared_path))
        self.resident_base = resident
        try:
            with self.base.lock:
                self.base.pause()
                self._attach(spec)
            self.model = self.base.model
            self.layers_per_device = self.base.layers_per_device
            self.closed_form_head = not spec.full_finetune  # a frozen lm_head (head_token_logprobs' closed form)
            with self.base.turn(self):
                self._init_memory(self.model, self.model.config.to_dict(), max(self.layers_per_device))
                self._init_training({n: p for n, p in self.model.named_parameters() if p.requires_grad}, reducer)
                self._total_parameters = sum(p.numel() for p in self.model.parameters())
                if spec.init_adapter_path:
                    self.renumber(versions.FIRST)  # the warm-start adapter is a policy of its own: v0 stays the base
        except BaseException:
            self._bases.release(self.base, self)
            raise

    @staticmethod
    def _load_base(spec: TrainingSpec, devices: list[torch.device], shared_path: str = "") -> SharedBase:
        """The base loaded and placed on its devices (layer split included), before any job's adapters; its
        weights the co-located engine's own where ``shared_path`` holds this model (shared_base.alias_base)."""
        model = AutoModelForCausalLM.from_pretrained(spec.base_model_path, dtype=TORCH_DTYPES[spec.dtype],
                                                     use_safetensors=True)
        model.eval()
        fingerprint = base_model_fingerprint(spec.base_model_path)
        if shared_path:
            from lorarl.contract.base_segment import open_shared_base

            segment = open_shared_base(shared_path)
            if segment.fingerprint != fingerprint or len(devices) != 1 or \
                    torch.device(segment.device).type != devices[0].type:
                segment.close()
                logger.warning("job base %s (%s on %s) is not the shared base (%s on %s): it gets a copy of "
                               "its own", spec.base_model_path, fingerprint, devices, segment.fingerprint,
                               segment.device)
            else:
                count = alias_base(model, segment)
                logger.info("base %s: %d parameters are views of the shared base (%.1f MiB held once)",
                            spec.base_model_path, count, segment.nbytes / 2**20)
        routing_replay.install(model)  # MoE routers replay recorded experts when a batch carries them (R3)
        layers_per_device = place_by_layers(model, devices)
        return SharedBase(BaseKey.of(spec), model, fingerprint, layers_per_device)

    def _attach(self, spec: TrainingSpec) -> None:
        """This job's adapters on the base (drawn on CPU, then on each layer's device), its RNG seeded."""
        model = self.base.model
        seed_everything(spec.seed)
        if spec.full_finetune:
            model.requires_grad_(True)
            self.slot = AdapterSlot({})
        else:
            self.slot = attach_lora(model, spec.lora, seed=spec.seed)
            if spec.init_adapter_path:
                try:
                    load_peft_state_dict(model, read_peft_tensors(spec.init_adapter_path))
                except ValueError as e:
                    raise ValueError(f"init_adapter_path {spec.init_adapter_path!r}: {e}") from None
        self.rng = RngState.capture()
        self.base.join(self)
        self._fingerprint = self.base.fingerprint

    def on_turn(self) -> None:
        self._apply_memory_mode()

    @classmethod
    def create(cls, spec: TrainingSpec, bases: BaseRegistry | None = None) -> TorchEngine:
        return cls(spec, bases=bases)

    def memory(self) -> tuple[int, int, int]:
        return self.base.base_bytes, len(self.base.tenants), self.job_bytes

    def close(self) -> None:
        """This job's adapters leave the base; the base goes with its last job."""
        self._bases.release(self.base, self)

    # ------------------------------------------------------------ turns on a shared base

    def forward_backward(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        with self.base.turn(self):
            return super().forward_backward(batch, loss)

    def forward_with_logprobs(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None,
                              forward_only: bool = False) -> tuple[Metrics, list[list[float]]]:
        with self.base.turn(self):
            return super().forward_with_logprobs(batch, loss, forward_only)

    def optim_step(self, lr: float | None = None, adam: AdamStep | None = None) -> Metrics:
        with self.base.turn(self):
            return super().optim_step(lr, adam)

    def train_step(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        with self.base.turn(self):
            return super().train_step(batch, loss)

    def warm_up(self) -> None:
        with self.base.turn(self):
            super().warm_up()

    def compute_logprobs(self, batch: Sequence[TrajectoryRecord], reference: bool = False) -> list[list[float]]:
        with self.base.turn(self):
            return super().compute_logprobs(batch, reference)

    def save_checkpoint(self, path: str | Path, data_cursor: Any = None) -> CheckpointInfo:
        with self.base.turn(self):
            return super().save_checkpoint(path, data_cursor)

    def load_checkpoint(self, path: str | Path) -> CheckpointInfo:
        with self.base.turn(self):
            return super().load_checkpoint(path)

    def model_devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self.devices))

    @property
    def total_parameters(self) -> int:
        return self._total_parameters

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def route_shape(self) -> tuple[int, int, int] | None:
        """(MoE layers, top_k, experts) when this engine replays recorded routes (R3), else None."""
        if self.spec.routing_replay == "off":
            return None
        return routing_replay.route_shape(self.model)

    def routing_metrics(self, batch: Sequence[TrajectoryRecord]) -> Metrics:
        counts = [*routing_replay.take_counts(self.model), *routing.record_counts(batch)]
        return routing.metrics_from_counts(self._reduce_routing_counts(counts))

    def _reduce_routing_counts(self, counts: list[int]) -> list[int]:
        """``counts`` over every rank holding a share of the batch: this process's alone here."""
        return counts

    # ------------------------------------------------------------ the RL step's model backend

    def completion_logprobs(self, batch: PackedBatch, entropy_grad: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        return completion_logprobs(self.model, batch, entropy_grad, self.share_prompts, self.pack_completions,
                                   self.spec.memory.logits_chunk_tokens)


    def adapters_off(self) -> contextlib.AbstractContextManager[None]:
        return adapters_disabled(self.model)

    def set_training(self, training: bool) -> None:
        self.model.train(training)

    # ------------------------------------------------------------ export

    # Exports read this job's slot, not the attached adapters: no turn needed, so another job keeps computing.

    def export_adapter(self, path: str | Path) -> Path:
        if self.spec.full_finetune:
            raise EngineStateError("a full fine-tune has no adapter to export; export the merged model")
        return save_peft_adapter(self.model, self.spec.lora, self.spec.base_model_name_or_path, path,
                                 slot=self.slot)

    def export_merged(self, path: str | Path) -> Path:
        return save_merged_model(self.model, self.spec.base_model_path, path, slot=self._export_slot())

    def iter_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.spec.full_finetune:
            raise EngineStateError("a full fine-tune has no adapter tensors")
        yield from peft_state_dict(self.model, self.slot).items()

    def iter_merged_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from iter_merged_weights(self.model, slot=self._export_slot())

    def iter_base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from iter_merged_weights(self.model, merge=False)

    def _export_slot(self) -> AdapterSlot | None:
        return None if self.spec.full_finetune else self.slot
