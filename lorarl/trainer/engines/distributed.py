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
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lorarl.common.tcp_store import client_store, master_store
from lorarl.platform import backend_for, device_kind, load_npu
from lorarl.trainer.engines.api import (
    CheckpointInfo,
    EngineStateError,
    Metrics,
    TrainEngine,
    TrainingSpec,
    TrajectoryRecord,
)
from lorarl.trainer.engines.devices import bind_device
from lorarl.trainer.engines.torch.engine import TorchEngine, device_for
from lorarl.trainer.rl.losses import LossSpec
from lorarl.trainer.rl.step import BatchTotals


def init_distributed(device: str, rank: int, world_size: int, init_method: str | None = None,
                     timeout_s: float = 300.0, store: dist.Store | None = None) -> None:
    """Joins the default process group with the backend the device needs, on ``store`` (see rank_store)
    or at ``init_method`` (e.g. env:// under a launcher that hosts the store itself)."""
    if device_kind(device) == "npu":
        load_npu()  # registers hccl
    bind_device(device)  # nccl and hccl bind each rank to its current device
    if store is not None:
        # init_method rendezvous prefixes its keys "default_pg/": ranks joining through init_method (followers)
        # and through this store then meet under the same keys.
        dist.init_process_group(backend_for(device), store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))


def rank_store(host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0) -> dist.Store:
    """The ranks' rendezvous store: rank 0 hosts it on ``host`` only (a tcp:// init_method would listen on
    every interface, unauthenticated), the others connect to it."""
    if rank == 0:
        return master_store(host, port, world_size, timeout_s)
    return client_store(host, port, world_size, timeout_s)


def shard_by_group(records: Sequence[TrajectoryRecord], rank: int, world_size: int) -> list[TrajectoryRecord]:
    """This rank's trajectories: whole groups dealt round-robin, so group advantages stay exact."""
    order: dict[object, int] = {}
    for rec in records:
        order.setdefault(rec.group_key(), len(order))
    return [rec for rec in records if order[rec.group_key()] % world_size == rank]


def all_reduce_ints(values: Sequence[int], op: dist.ReduceOp, device: torch.device,
                    group: dist.ProcessGroup | None = None) -> list[int]:
    """Integer ``values`` (counts, shapes, steps) reduced exactly over ``group``, in int64."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return [int(v) for v in t.tolist()]


def all_reduce_floats(values: list[float], op: dist.ReduceOp, device: torch.device,
                      group: dist.ProcessGroup | None = None) -> list[float]:
    """Metric ``values`` reduced over ``group``, in float32: HCCL has no float64 collectives, and what
    goes through here is logged, not trained on (counts the loss divides by go through all_reduce_ints)."""
    t = torch.tensor(values, dtype=torch.float32, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


class SummedShares:
    """The totals and metrics half of a GradientReducer whose ranks each hold a share of the batch: counts
    are summed (Dr.GRPO's length: the max), and every metric, already weighted by its rank's global
    share, is summed into the full-batch value. Subclasses say which group reduces (`_all_reduce`)."""

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        raise NotImplementedError

    def _all_reduce_ints(self, values: list[int], op: dist.ReduceOp) -> list[int]:
        raise NotImplementedError

    def reduce_totals(self, totals: BatchTotals) -> BatchTotals:
        sequences, tokens, loss_tokens, loss_sequences = self._all_reduce_ints(
            [int(totals.sequences), int(totals.tokens), int(totals.loss_tokens), int(totals.loss_sequences)],
            dist.ReduceOp.SUM)
        (norm,) = self._all_reduce_ints([totals.norm_tokens], dist.ReduceOp.MAX)
        return BatchTotals(float(sequences), float(tokens), float(loss_tokens), norm, float(loss_sequences))

    def reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        keys = sorted(sums)  # every rank reports the same keys (same loss settings)
        return dict(zip(keys, self._all_reduce([sums[k] for k in keys], dist.ReduceOp.SUM), strict=True))


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
