"""Data parallelism for the torch engine: N processes, each with whole groups of the batch.

Kept explicit instead of wrapping the model in DDP: every rank computes its micro-batch loss
shares against *global* totals (sequences, loss tokens, Dr.GRPO length, all-reduced before the
backward), so the plain SUM of the ranks' gradients is the full-batch gradient, bit for bit the
same rule a single process uses. Adapters start identical (broadcast from rank 0) and every rank
applies the same summed gradient, so they stay identical without further synchronisation.

Backends by device: gloo on CPU, nccl on CUDA, hccl on Ascend NPU (untested here).
Checkpoints are written by rank 0 (its RNG state) and read by every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lorarl.trainer.engines.api import (
    CheckpointInfo,
    EngineStateError,
    Metrics,
    TrainEngine,
    TrainingSpec,
    TrajectoryRecord,
)
from lorarl.trainer.engines.distributed import SummedShares, all_reduce_floats, all_reduce_ints, shard_by_group
from lorarl.trainer.engines.torch.engine import TorchEngine, device_for
from lorarl.trainer.rl.losses import LossSpec


class DataParallelReducer(SummedShares):
    """The RL step's GradientReducer over the default process group: global totals, summed metrics and
    gradients (lorarl.trainer.rl.step). Every rank runs its own micro-batches: no idle ones."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        return all_reduce_floats(values, op, self.device)

    def _all_reduce_ints(self, values: list[int], op: dist.ReduceOp) -> list[int]:
        return all_reduce_ints(values, op, self.device)

    def sync_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """One flat SUM all-reduce of every trainable gradient (they are full-batch shares already)."""
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset: offset + n].view_as(g))
            offset += n

    def idle_micro_steps(self, planned: int) -> int:
        return 0


class DataParallelEngine(TorchEngine):
    """TorchEngine whose loss shares, metrics and gradients are reduced over the default process group
    (its RL step's reducer is a DataParallelReducer).

    Every rank calls forward_backward with its own shard (see shard_by_group; an empty shard is
    fine) and then optim_step, in lockstep. With ``full_batch`` every rank is handed the whole
    batch instead (what a multi-rank trainer service does) and takes its shard itself.
    """

    def __init__(self, spec: TrainingSpec, full_batch: bool = False) -> None:
        if not dist.is_initialized():
            raise EngineStateError("DataParallelEngine needs torch.distributed initialised (init_distributed)")
        super().__init__(spec, reducer=DataParallelReducer(device_for(spec.device)))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.full_batch = full_batch
        with torch.no_grad():
            for p in self._trainable:
                dist.broadcast(p.data, src=0)

    def forward_backward(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        if self.full_batch:
            batch = shard_by_group(batch, self.rank, self.world_size)
        return super().forward_backward(batch, loss)

    def _reduce_routing_counts(self, counts: list[int]) -> list[int]:
        """Routing replay's counts summed over every rank's shard before the ratios are taken, so rank 0 reports
        the whole batch. Every rank gets here in lockstep (forward_backward's routing_metrics), empty shards
        included; dense jobs and jobs routing live skip the collective."""
        if self.route_shape is None:
            return counts
        return all_reduce_ints(counts, dist.ReduceOp.SUM, self.device)

    def forward_with_logprobs(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None,
                              forward_only: bool = False) -> tuple[Metrics, list[list[float]]]:
        """Not here: each rank holds its shard's logprobs only."""
        return TrainEngine.forward_with_logprobs(self, batch, loss, forward_only)

    def save_checkpoint(self, path: str | Path, data_cursor: Any = None) -> CheckpointInfo:
        info = super().save_checkpoint(path, data_cursor) if self.rank == 0 else None
        dist.barrier()
        return info or CheckpointInfo(Path(path), self._step, self._version, data_cursor)

    def _rank0_writes(self, write: Callable[[], Path], path: str | Path) -> Path:
        """Rank 0 writes (every rank holds the same weights); all ranks learn whether it worked, so none waits
        for a writer that failed."""
        error: BaseException | None = None
        if self.rank == 0:
            try:
                write()
            except Exception as e:  # re-raised below, once the others know
                error = e
        (failed,) = all_reduce_floats([float(error is not None)], dist.ReduceOp.MAX, self.device)
        if error is not None:
            raise error
        if failed:
            raise EngineStateError(f"rank 0 could not write {str(path)!r}")
        return Path(path)

    def export_adapter(self, path: str | Path) -> Path:
        return self._rank0_writes(lambda: super(DataParallelEngine, self).export_adapter(path), path)

    def export_merged(self, path: str | Path) -> Path:
        return self._rank0_writes(lambda: super(DataParallelEngine, self).export_merged(path), path)
