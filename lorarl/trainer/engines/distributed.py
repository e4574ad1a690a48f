"""What both engines' ranks share: joining the default process group (the backend the device needs:
lorarl.platform), the ranks' rendezvous store, sharding a batch by whole groups, small all-reduces, and the
totals-and-metrics half of a gradient reducer over ranks that each hold a share of the batch.

The torch engine's data parallelism is lorarl.trainer.engines.torch.data_parallel; Megatron's,
lorarl.trainer.engines.megatron.data_parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from lorarl.common.tcp_store import client_store, master_store
from lorarl.platform import backend_for, device_kind, load_npu
from lorarl.trainer.engines.api import (
    TrajectoryRecord,
)
from lorarl.trainer.engines.devices import bind_device
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
