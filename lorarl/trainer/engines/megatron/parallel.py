"""Process groups for the megatron engine: torch.distributed plus megatron's TP/PP/EP groups.

Megatron lays ranks out as tp-cp-ep-dp-pp: attention and dense layers are replicated over the
data-parallel dimension, and expert parallelism carves experts out of that same dimension (each
EP rank holds num_experts / ep experts, feeding its own tokens). A single process needs no
launcher: `init_parallel` then binds a free loopback port itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lorarl.common.tcp_store import master_store
from lorarl.trainer.engines.distributed import init_distributed
from lorarl.trainer.engines.megatron import cpu_compat

_owns_process_group = False


@dataclass(frozen=True)
class ParallelSettings:
    """Model-parallel sizes: tensor (tp), pipeline (pp) and expert (ep); data parallel is what remains."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for field, value in self._named():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")

    def _named(self) -> tuple[tuple[str, int], ...]:
        return (("megatron.tensor_parallel_size", self.tp), ("megatron.pipeline_parallel_size", self.pp),
                ("megatron.expert_parallel_size", self.ep))

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def check_world(self, world_size: int) -> None:
        """Megatron needs world % (tp*pp) == 0 and, experts being sharded over tp as well, world % (tp*ep*pp) == 0."""
        if world_size % (self.tp * self.pp):
            raise ValueError(f"megatron.tensor_parallel_size * megatron.pipeline_parallel_size = {self.tp * self.pp} "
                             f"must divide the world size {world_size}")
        if world_size % (self.tp * self.ep * self.pp):
            raise ValueError(f"megatron.expert_parallel_size={self.ep} times tp*pp={self.tp * self.pp} "
                             f"must divide the world size {world_size}")

    def check_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int, num_experts: int) -> None:
        """Every split must be even: heads and KV groups over tp, layers over pp, experts over ep."""
        if num_heads % self.tp or num_kv_heads % self.tp:
            raise ValueError(f"megatron.tensor_parallel_size={self.tp} must divide the attention heads ({num_heads}) "
                             f"and key/value heads ({num_kv_heads})")
        if num_layers % self.pp:
            raise ValueError(f"megatron.pipeline_parallel_size={self.pp} must divide the layers ({num_layers})")
        if self.ep > 1 and not num_experts:
            raise ValueError(f"megatron.expert_parallel_size={self.ep} needs a mixture-of-experts model")
        if num_experts and num_experts % self.ep:
            raise ValueError(f"megatron.expert_parallel_size={self.ep} must divide the experts ({num_experts})")


def init_parallel(settings: ParallelSettings, device: str = "cpu", seed: int = 0, *, rank: int = 0,
                  world_size: int = 1, init_method: str | None = None, timeout_s: float = 300.0) -> None:
    """Joins (or creates) the default process group, builds megatron's groups and seeds its RNG streams.

    When torch.distributed is already initialised its rank/world are used and the arguments ignored.
    ``seed`` seeds megatron's data-, tensor- and expert-parallel RNG streams (dropout, init).
    """
    global _owns_process_group
    from megatron.core import parallel_state, tensor_parallel

    if device == "cpu":
        cpu_compat.enable()
    if not dist.is_initialized():
        if world_size == 1 and init_method is None:  # a group of one, its store on loopback only
            init_distributed(device, 0, 1, timeout_s=timeout_s, store=master_store("127.0.0.1", 0, 1, timeout_s))
        elif init_method is None:
            raise ValueError("init_method is required when world_size > 1")
        else:
            init_distributed(device, rank, world_size, init_method, timeout_s)
        _owns_process_group = True
    settings.check_world(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=settings.tp, pipeline_model_parallel_size=settings.pp,
        expert_model_parallel_size=settings.ep, distributed_timeout_minutes=max(1, int(timeout_s // 60)))
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown() -> None:
    """Destroys megatron's groups, the default process group if `init_parallel` created it, and the CPU patches."""
    global _owns_process_group
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_process_group = False
    cpu_compat.disable()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
