"""Builds the engine a TrainingSpec names. Apart from engine_api, which the engines themselves import: the
interface stays below the engines, and only this factory sits above them (no import circle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorarl.common.errors import FailedPreconditionError, InvalidArgumentError
from lorarl.trainer.engines.api import TrainEngine, TrainingSpec

if TYPE_CHECKING:
    from lorarl.trainer.engines.torch.shared_base import BaseRegistry


def check_device(device: str, layer_devices: int = 1) -> None:
    """The job's device (and the ``layer_devices - 1`` after it, for a layer split) exists in this process:
    FAILED_PRECONDITION for a missing accelerator kind, INVALID_ARGUMENT for an index past the devices
    present (instead of torch's AssertionError later). A multi-rank trainer checks the job against its
    ranks first (lorarl.trainer.ranks.rank_engines)."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return
    import torch

    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    else:
        from lorarl.platform import load_npu

        count = torch.npu.device_count() if load_npu() else 0
    if count == 0:
        raise FailedPreconditionError(f"this trainer has no {kind} device (torch {torch.__version__}); "
                                      "use device 'cpu' or a trainer on an accelerator")
    if index and int(index) >= count:
        raise InvalidArgumentError("config.device", f"{device}: this trainer has {count} {kind} device(s), "
                                                    f"{kind}:0..{kind}:{count - 1}")
    last = int(index or 0) + layer_devices - 1
    if last >= count:
        raise InvalidArgumentError("config.layer_devices", f"{layer_devices} devices from {device} need "
                                                           f"{kind}:{last}; this trainer has {count} {kind} device(s)")


def create_engine(spec: TrainingSpec, bases: BaseRegistry | None = None) -> TrainEngine:
    """The engine named by ``spec.engine``, imported lazily (torch is heavy, Megatron optional). ``bases``: the
    trainer's resident bases, which a torch-engine job shares (lorarl.trainer.engines.torch.shared_base)."""
    check_device(spec.device, spec.layer_devices)
    if spec.engine == "torch":
        from lorarl.trainer.engines.torch.engine import TorchEngine

        return TorchEngine.create(spec, bases)
    if spec.engine == "megatron":
        from lorarl.trainer.engines.megatron.engine import MegatronEngine

        return MegatronEngine.create(spec)
    raise ValueError(f"engine {spec.engine!r} is not available in this build")
