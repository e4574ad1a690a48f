"""Data parallelism inside the megatron engine: each DP rank takes its share of a batch every rank holds.

Every rank receives the same full batch; the engine keeps whole GRPO groups per data-parallel rank
(`shard_by_group`, as the torch engine's DataParallelEngine is fed) and sums counts, metrics and
gradients over megatron's data-parallel group, so the step equals the full-batch step. With expert
parallelism (experts carved out of the data-parallel ranks) a MoE layer's forward is a collective
over TP x EP: data-parallel ranks then run the same number of forward passes on the same [B, S]
shape (`lockstep_steps`, `pad_ids`; the allgather dispatcher needs equal token counts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lorarl.trainer.engines.api import TrajectoryRecord
from lorarl.trainer.engines.distributed import (
    SummedShares,
    all_reduce_floats,
    all_reduce_ints,
    shard_by_group,
)
from lorarl.trainer.engines.plain_collectives import all_gather_plain, broadcast_plain


class MegatronDataParallel:
    """This rank's place in megatron's data-parallel and pipeline groups, and the collectives over them."""

    def __init__(self, device: torch.device) -> None:
        from megatron.core import parallel_state as ps

        self.device = device
        self.group = ps.get_data_parallel_group()
        self.rank = ps.get_data_parallel_rank()
        self.size = ps.get_data_parallel_world_size()
        # MoE forward passes span TP x EP, i.e. other data-parallel ranks: they must step together.
        self.lockstep = self.size > 1 and ps.get_expert_model_parallel_world_size() > 1
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.last_stage_rank = ps.get_pipeline_model_parallel_last_rank()

    # ------------------------------------------------------------ the batch

    def check_same_batch(self, records: Sequence[TrajectoryRecord]) -> None:
        """Fails on every rank when the ranks were handed different batches (each must get the full batch)."""
        if dist.get_world_size() == 1:
            return
        n, tokens = len(records), sum(r.num_tokens for r in records)
        most_n, most_tokens, least_n, least_tokens = all_reduce_ints(
            [n, tokens, -n, -tokens], dist.ReduceOp.MAX, self.device)
        if most_n != -least_n or most_tokens != -least_tokens:
            raise ValueError("engine 'megatron': every rank must be given the same full batch (it takes its "
                             f"data-parallel share itself); got between {-least_n} and {most_n} trajectories")

    def share(self, records: Sequence[TrajectoryRecord]) -> list[int]:
        """Indices of this data-parallel rank's records: whole groups, round-robin, original order."""
        mine = shard_by_group(records, self.rank, self.size)
        out, j = [], 0
        for i, rec in enumerate(records):  # shard_by_group keeps order: match it back by identity
            if j < len(mine) and rec is mine[j]:
                out.append(i)
                j += 1
        return out

    # ------------------------------------------------------------ reductions

    def all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        return list(values) if self.size == 1 else all_reduce_floats(values, op, self.device, self.group)

    def all_reduce_ints(self, values: list[int], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[int]:
        return list(values) if self.size == 1 else all_reduce_ints(values, op, self.device, self.group)

    def merge(self, local: dict[int, Any]) -> dict[int, Any]:
        """The union of every data-parallel rank's ``{record index: value}``."""
        if self.size == 1:
            return local
        return {k: v for part in all_gather_plain(local, self.group) for k, v in part.items()}

    def from_last_stage(self, obj: Any) -> Any:
        """The last pipeline stage's ``obj`` on every stage (where losses and logits exist)."""
        if self.pp_size == 1:
            return obj
        return broadcast_plain(obj, self.last_stage_rank, self.pp_group)

    # ------------------------------------------------------------ lockstep under expert parallelism

    def lockstep_steps(self, steps: int) -> int:
        """How many forward passes (micro-batches) every rank runs: its own, or the most of any DP rank."""
        if not self.lockstep:
            return steps
        return self.all_reduce_ints([steps], dist.ReduceOp.MAX)[0]

    def pad_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` [B, S] right/bottom-padded with token 0 to the largest [B, S] of the DP ranks (causal
        attention: real positions never see padding; padded rows are dropped by the caller)."""
        if not self.lockstep:
            return ids
        b, s = self.all_reduce_ints([ids.shape[0], ids.shape[1]], dist.ReduceOp.MAX)
        return F.pad(ids, (0, s - ids.shape[1], 0, b - ids.shape[0]))


class MegatronReducer(SummedShares):
    """The RL step's GradientReducer for the Megatron engine: totals and metrics summed over the data-parallel
    group, gradients by the adapters' own groups (``sync``: MegatronLora.sync_gradients), and the idle
    micro-steps that keep expert-parallel ranks in lockstep."""

    def __init__(self, dp: MegatronDataParallel, sync: Callable[[], None]) -> None:
        self.dp = dp
        self._sync = sync

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        return self.dp.all_reduce(values, op)

    def _all_reduce_ints(self, values: list[int], op: dist.ReduceOp) -> list[int]:
        return self.dp.all_reduce_ints(values, op)

    def sync_gradients(self, params: Sequence[nn.Parameter]) -> None:
        self._sync()

    def idle_micro_steps(self, planned: int) -> int:
        return self.dp.lockstep_steps(planned) - planned
