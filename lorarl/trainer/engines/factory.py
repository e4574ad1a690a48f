"""Builds the engine a JobSpec names. Apart from engine_api, which the engines themselves import: the
interface stays below the engines, and only this factory sits above them (no import circle)."""

from __future__ import annotations

from lorarl.trainer.engines.api import JobSpec, TrainEngine


def create_engine(spec: JobSpec) -> TrainEngine:
    """The engine named by ``spec.engine``, imported lazily (torch is heavy, Megatron optional)."""
    if spec.engine == "torch":
        from lorarl.trainer.engines.torch_engine import TorchEngine

        return TorchEngine.create(spec)
    if spec.engine == "megatron":
        from lorarl.trainer.engines.megatron.engine import MegatronEngine

        return MegatronEngine.create(spec)
    raise ValueError(f"engine {spec.engine!r} is not available in this build")
