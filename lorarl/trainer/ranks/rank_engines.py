"""One rank's engines and how it runs a decoded command on them (rank 0 and followers alike).

Every rank of a multi-rank trainer holds its own engine per job, built from the same TrainingSpec with
only the device changed to this rank's (cuda:LOCAL_RANK). Running the very same code on rank 0 and
on the followers is what keeps them in lockstep: same engine class, same calls, same arguments.
Every rank receives the full batch; the engine picks its data-parallel share itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lorarl.trainer.engines.api import TrainEngine, TrainingSpec
from lorarl.trainer.engines.factory import create_engine
from lorarl.trainer.ranks.commands import Command, CommandError

EngineFactory = Callable[[TrainingSpec], TrainEngine]


def rank_device(device: str, local_rank: int, world_size: int) -> str:
    """cuda / npu -> that type at index LOCAL_RANK when there are several ranks; cpu stays cpu."""
    kind = device.split(":", 1)[0]
    if world_size == 1 or kind == "cpu":
        return device
    return f"{kind}:{local_rank}"


def parallel_engine(world_size: int) -> EngineFactory:
    """The engine factory of a trainer with `world_size` ranks: torch jobs are data parallel over all of them."""

    def create(spec: TrainingSpec) -> TrainEngine:
        if spec.engine == "torch" and world_size > 1:
            from lorarl.trainer.engines.torch.data_parallel import DataParallelEngine

            return DataParallelEngine(spec, full_batch=True)
        return create_engine(spec)

    return create


def check_job_fits(spec: TrainingSpec, world_size: int, device: str) -> tuple[str, str] | None:
    """(field, problem) when the job's parallel sizes or device do not fit a trainer of `world_size` ranks."""
    if world_size == 1:
        return None
    if re.fullmatch(r"(cuda|npu):\d+", spec.device):
        return "config.device", (f"names one device ({spec.device!r}) but the trainer has {world_size} ranks, each on "
                                 f"its own device; give the type only ({spec.device.split(':')[0]!r})")
    if spec.device.split(":")[0] != device.split(":")[0]:
        return "config.device", (f"{spec.device!r} differs from the trainer's device {device!r}, which its "
                                 f"{world_size} ranks were started on (trainer.device)")
    if spec.layer_devices > 1:
        return "config.layer_devices", (f"a layer split ({spec.layer_devices} devices) runs in a one-rank trainer; "
                                        f"this one has {world_size} ranks (trainer.ranks)")
    if spec.engine == "megatron":
        m = spec.megatron
        if world_size % (m.tensor_parallel_size * m.pipeline_parallel_size):
            field = ("config.megatron.tensor_parallel_size" if world_size % m.tensor_parallel_size
                     else "config.megatron.pipeline_parallel_size")
            return field, (f"tensor_parallel_size * pipeline_parallel_size = "
                           f"{m.tensor_parallel_size * m.pipeline_parallel_size} must divide the trainer's "
                           f"{world_size} ranks (trainer.ranks)")
        if world_size % (m.tensor_parallel_size * m.pipeline_parallel_size * m.expert_parallel_size):
            return "config.megatron.expert_parallel_size", (
                f"expert_parallel_size * tensor_parallel_size * pipeline_parallel_size = "
                f"{m.expert_parallel_size * m.tensor_parallel_size * m.pipeline_parallel_size} must divide the "
                f"trainer's {world_size} ranks (trainer.ranks)")
    return None


class RankEngines:
    """This rank's engines by key, and the runner of decoded commands on them."""

    def __init__(self, local_rank: int, world_size: int, factory: EngineFactory | None = None) -> None:
        self.local_rank, self.world_size = local_rank, world_size
        self.factory = factory or parallel_engine(world_size)
        self.engines: dict[str, TrainEngine] = {}

    def engine(self, key: str) -> TrainEngine:
        engine = self.engines.get(key)
        if engine is None:
            raise CommandError(f"this rank has no engine {key!r}")
        return engine

    def run(self, command: Command) -> Any:
        """Runs the command here; an `iter` command returns its (not yet consumed) iterator."""
        if command.op == "create":
            if command.engine in self.engines:
                raise CommandError(f"engine {command.engine!r} exists on this rank already")
            spec: TrainingSpec = command.args["spec"]
            self.engines[command.engine] = self.factory(
                replace(spec, device=rank_device(spec.device, self.local_rank, self.world_size)))
            return None
        if command.op == "close":
            self.engines.pop(command.engine, None)  # the last reference: the engine's memory goes with it
            return None
        if command.op in ("call", "iter"):
            return getattr(self.engine(command.engine), command.method)(**command.args)
        return None  # ping, stop
