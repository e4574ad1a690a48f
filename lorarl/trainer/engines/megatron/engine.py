"""The Megatron trainer engine: a frozen megatron-core GPTModel (TP/PP/EP sharded) plus parallel LoRA.

Trains with exactly the torch engine's step (lorarl.trainer.rl.step: advantages, micro-batches, loss
shares; lorarl.trainer.engines.policy_engine: AdamW, schedule, checkpoints); it is the step's model
backend: logits come from megatron's GPTModel, the reference policy switches the hooked adapters off,
parameters are named by their full-model megatron names, and exports are converted to HF / PEFT
names. Its ranks combine the step through a `MegatronReducer`.

Multi-rank (world = tp * pp * dp; megatron carves expert parallelism out of dp, world % (tp*ep*pp) == 0):
every rank makes the same calls with the same FULL batch. The engine takes its data-parallel share
itself (whole groups, `data_parallel`), measures loss shares against global totals and sums
gradients over the data-parallel groups (`MegatronLora.sync_gradients`), so the step equals the
full-batch step whatever the layout. Under expert parallelism data-parallel ranks run their forward
passes in lockstep (MoE layers are collectives across them). With pp > 1 each micro-batch runs
through megatron's 1F1B pipeline schedule, the last stage computes the loss, and metrics and
logprobs are broadcast from it, so every rank returns the same values. Checkpoints and PEFT
exports hold full (gathered) tensors, written by global rank 0, read by all: layout independent.
Merged export needs pp == 1. MoE routers replay a batch's recorded routes (R3) in every forward, as the
torch engine's do (lorarl.trainer.engines.megatron.routing_replay).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.trainer.engines import checkpoint as ckpt
from lorarl.trainer.engines.api import CheckpointInfo, Metrics, TrainEngine, TrainingSpec, TrajectoryRecord
from lorarl.trainer.engines.megatron.data_parallel import MegatronDataParallel, MegatronReducer
from lorarl.trainer.engines.megatron.export import iter_hf_weights, peft_tensors, save_merged, save_peft
from lorarl.trainer.engines.megatron.lora import inject_megatron_lora
from lorarl.trainer.engines.megatron.model import build_gpt_model, compute_logits, pipeline_backward
from lorarl.trainer.engines.megatron.parallel import ParallelSettings
from lorarl.trainer.engines.megatron.routing_replay import RouterReplays, routing_counts
from lorarl.trainer.engines.megatron.routing_replay import install as install_replay
from lorarl.trainer.engines.policy_engine import TORCH_DTYPES, PolicyEngine, device_for, seed_everything, token_logprobs
from lorarl.trainer.rl import routing
from lorarl.trainer.rl.batching import PackedBatch, micro_batches, pack
from lorarl.trainer.rl.losses import LossSpec
from lorarl.trainer.rl.step import LossFn, empty_batch


def parallel_settings(spec: TrainingSpec) -> ParallelSettings:
    m = spec.megatron
    return ParallelSettings(tp=m.tensor_parallel_size, pp=m.pipeline_parallel_size, ep=m.expert_parallel_size)


def _checkpoint_elements(model_dir: str) -> int:
    """Parameters of the HF checkpoint, from the safetensors headers (no tensor is read)."""
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                total += math.prod(f.get_slice(name).get_shape())
    return total


class MegatronEngine(PolicyEngine):
    """TrainEngine on megatron-core: LoRA adapters on a frozen GPTModel, TP/PP/EP and data parallel."""

    def __init__(self, spec: TrainingSpec) -> None:
        if spec.full_finetune:
            raise ValueError("engine 'megatron' trains LoRA adapters only (full_finetune is a torch-engine baseline)")
        self.settings = parallel_settings(spec)
        self.spec = spec
        self.device = device_for(spec.device)
        seed_everything(spec.seed)
        self._fingerprint = base_model_fingerprint(spec.base_model_path)
        built = build_gpt_model(spec.base_model_path, self.settings, device=spec.device,
                                dtype=TORCH_DTYPES[spec.dtype])
        self.model, self.layout = built.model, built.layout
        self.model.eval()
        self.replay: RouterReplays = install_replay(self.model, self.layout)  # R3: routes a batch carries
        self.dp = MegatronDataParallel(self.device)
        self.lora = inject_megatron_lora(self.model, spec.lora, spec.seed, self.layout)
        self._base_elements = _checkpoint_elements(spec.base_model_path)
        # Checkpointing wraps this rank's TransformerLayers (its pipeline stage's share of the model).
        self._init_memory(self.model, built.hf_config, len(self.model.decoder.layers))
        self._init_training(self.lora.named_parameters(), MegatronReducer(self.dp, self.lora.sync_gradients))

    @classmethod
    def create(cls, spec: TrainingSpec) -> MegatronEngine:
        return cls(spec)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    # ------------------------------------------------------------ sizes (whole model, not this rank's shard)

    @property
    def trainable_parameters(self) -> int:
        return sum(math.prod(s) for s in self._checkpoint_shapes().values())

    @property
    def total_parameters(self) -> int:
        return self._base_elements + self.trainable_parameters

    @property
    def vocab_size(self) -> int:
        return self.layout.vocab_size

    # ------------------------------------------------------------ the RL step's model backend

    def _forward_ids(self, batch: PackedBatch) -> torch.Tensor:
        """The ids this forward runs (padded in lockstep), the batch's routes set for its MoE routers (R3)."""
        ids = self.dp.pad_ids(batch.input_ids)
        self.replay.set(batch.routes, (ids.shape[0], ids.shape[1]))
        return ids

    def _logits(self, batch: PackedBatch) -> torch.Tensor | None:
        """Logits [B, S, vocab] (None on a pipeline stage other than the last); padded in lockstep."""
        if self.settings.pp > 1 and torch.is_grad_enabled():
            raise RuntimeError("with pipeline parallelism gradients flow only through loss_backward's schedule")
        logits = compute_logits(self.model, self._forward_ids(batch), self.layout.vocab_size)
        return None if logits is None else logits[: batch.input_ids.shape[0], : batch.input_ids.shape[1]]

    @staticmethod
    def _target_logprobs(logits: torch.Tensor, batch: PackedBatch, entropy_grad: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        index = batch.target_positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        return token_logprobs(logits.gather(1, index), batch.completion_ids, entropy_grad)

    def completion_logprobs(self, batch: PackedBatch, entropy_grad: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        # Right padding is harmless under a causal mask, so the padded rows need no attention mask.
        logits = self._logits(batch)
        if logits is None:  # not the last pipeline stage: placeholders, the loss lives on the last stage
            zeros = torch.zeros(batch.completion_ids.shape, device=self.device)
            return zeros, zeros
        return self._target_logprobs(logits, batch, entropy_grad)

    def loss_backward(self, batch: PackedBatch, entropy_grad: bool, loss_fn: LossFn) -> dict[str, float]:
        if self.settings.pp == 1:
            return super().loss_backward(batch, entropy_grad, loss_fn)
        metrics: list[dict[str, float]] = []
        b, s = batch.input_ids.shape

        def last_stage_loss(logits: torch.Tensor) -> torch.Tensor:
            loss, m = loss_fn(*self._target_logprobs(logits[:b, :s], batch, entropy_grad))
            metrics.append(m)
            return loss

        pipeline_backward(self.model, self._forward_ids(batch), self.layout.vocab_size, last_stage_loss)
        return self.dp.from_last_stage(metrics[0] if metrics else None)

    # ------------------------------------------------------------ data parallelism (every rank: the full batch)

    def forward_backward(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        """PolicyEngine.forward_backward on this data-parallel rank's share of the full ``batch``."""
        records = list(batch)
        self.dp.check_same_batch(records)
        try:
            return super().forward_backward([records[i] for i in self.dp.share(records)], loss)
        finally:
            self.replay.clear()

    def forward_with_logprobs(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None,
                              forward_only: bool = False) -> tuple[Metrics, list[list[float]]]:
        """Not here: data-parallel ranks split the batch and a pipeline's loss lives on its last stage."""
        return TrainEngine.forward_with_logprobs(self, batch, loss, forward_only)

    def compute_logprobs(self, batch: Sequence[TrajectoryRecord], reference: bool = False) -> list[list[float]]:
        """The full batch's logprobs on every rank: each DP rank computes its share, then they are merged."""
        records = list(batch)
        self.dp.check_same_batch(records)
        self.replay.forget()  # its routing figures are not reported: held only until the next forward_backward
        mine = self.dp.share(records)
        plan = micro_batches([records[i].num_tokens for i in mine], self.spec.optimizer.micro_batch_tokens)
        local: dict[int, list[float]] = {}
        try:
            for step in range(self.dp.lockstep_steps(len(plan))):
                idx = [mine[j] for j in plan[step]] if step < len(plan) else []
                micro = pack([records[i] for i in idx]).to(self.device) if idx else empty_batch(self.device)
                logp = self.rl.logprobs_no_grad(micro, reference=reference).cpu()
                for row, i in enumerate(idx):
                    local[i] = logp[row, : len(records[i].completion_token_ids)].tolist()
        finally:
            self.replay.clear()
        merged = self.dp.merge(self.dp.from_last_stage(local))
        return [merged[i] for i in range(len(records))]

    def adapters_off(self) -> contextlib.AbstractContextManager[None]:
        return self.lora.disabled()

    # ------------------------------------------------------------ routing replay (R3)

    @property
    def route_shape(self) -> tuple[int, int, int] | None:
        """(MoE layers, top_k, experts) of the whole model when this engine replays recorded routes, else None."""
        if self.spec.routing_replay == "off":
            return None
        return self.replay.shape

    def routing_metrics(self, batch: Sequence[TrajectoryRecord]) -> Metrics:
        """The torch engine's ``routing_*`` figures for the whole model and every data-parallel rank's share
        (``batch``: this rank's); a collective on every rank of a MoE model."""
        if self.replay.shape is None:
            return {}
        pp_group = self.dp.pp_group if self.dp.pp_size > 1 else None
        return routing.metrics_from_counts(
            routing_counts(self.replay, batch, self.device, pp_group, self.dp.all_reduce_ints))

    def set_training(self, training: bool) -> None:
        # Only LoRA dropout depends on the mode: the base is frozen with zero dropout, and megatron's MoE
        # layer refuses training mode under TP without sequence parallelism, so the base stays in eval.
        for adapter in self.lora.adapters:
            adapter.train(training)

    def _clip_gradients(self, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s rule on the norm of the whole (all ranks') adapter gradient."""
        norm = self.lora.grad_norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self._trainable:
            p.grad.mul_(coef.to(p.grad.device))
        return float(norm)

    # ------------------------------------------------------------ checkpoints: full tensors, rank 0 writes

    def _checkpoint_param_names(self) -> list[str]:
        return self.lora.full_names()

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.lora.full_shapes)

    def _training_state(self, data_cursor: Any) -> ckpt.TrainingState:
        names = self._checkpoint_param_names()
        local = list(self._named_trainable)
        opt = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        if opt["state"]:
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                full = self.lora.gather({n: opt["state"][i][key] for i, n in enumerate(local)})
                moments[key] = full
            step = opt["state"][0]["step"]
            state = {i: {"step": step.clone(), "exp_avg": moments["exp_avg"][n], "exp_avg_sq": moments["exp_avg_sq"][n]}
                     for i, n in enumerate(names)}
        groups = [{**g, "params": list(range(len(names)))} for g in opt["param_groups"]]
        rng_tensors, rng = ckpt.capture_rng(self.device)
        return ckpt.TrainingState(step=self._step, version=self._version, params=self.lora.full_tensors(),
                                  optimizer={"state": state, "param_groups": groups}, param_names=names,
                                  rng_tensors=rng_tensors, rng=rng, data_cursor=data_cursor)

    def _restore_training_state(self, state: ckpt.TrainingState) -> None:
        self.lora.load_full(state.params)
        local = list(self._named_trainable)
        index = {n: i for i, n in enumerate(state.param_names)}
        opt_state: dict[int, dict[str, Any]] = {}
        if state.optimizer["state"]:
            moments = {key: self.lora.shard({n: state.optimizer["state"][index[n]][key] for n in state.param_names})
                       for key in ("exp_avg", "exp_avg_sq")}
            opt_state = {i: {"step": state.optimizer["state"][index[n]]["step"].clone(),
                             "exp_avg": moments["exp_avg"][n].to(self.device),
                             "exp_avg_sq": moments["exp_avg_sq"][n].to(self.device)}
                         for i, n in enumerate(local)}
        groups = [{**g, "params": list(range(len(local)))} for g in state.optimizer["param_groups"]]
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})

    def _writes_checkpoint(self) -> bool:
        return self.rank == 0

    def _barrier(self) -> None:
        if dist.get_world_size() > 1:
            dist.barrier()

    def save_checkpoint(self, path: str | Path, data_cursor: Any = None) -> CheckpointInfo:
        info = super().save_checkpoint(path, data_cursor)
        self._barrier()  # no rank reads the checkpoint before rank 0 has written it
        return info

    # ------------------------------------------------------------ export (collectives: every rank calls)

    def iter_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from peft_tensors(self.lora.full_tensors(), self.layout).items()

    def iter_merged_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from iter_hf_weights(self.model, self.layout, self.lora, self.spec.lora.scale)

    def iter_base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from iter_hf_weights(self.model, self.layout)

    def export_adapter(self, path: str | Path) -> Path:
        tensors = dict(self.iter_adapter_tensors())
        if self.rank == 0:
            save_peft(tensors, self.spec.lora, self.spec.base_model_name_or_path, path)
        self._barrier()
        return Path(path)

    def export_merged(self, path: str | Path) -> Path:
        weights = self.iter_merged_tensors()
        if self.rank == 0:
            save_merged(weights, self.spec.base_model_path, path)
        else:
            for _ in weights:  # the stream is a collective: follow it to the end
                pass
        self._barrier()
        return Path(path)
