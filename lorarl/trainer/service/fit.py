"""Whether a new job fits the trainer's device before it is built, so a job too big for it is refused with
RESOURCE_EXHAUSTED and the figures instead of running every job on the trainer out of memory.

A job on a resident base adds its adapter, its gradients and Adam's two moments (4 x the adapter's fp32
bytes); a job on a base not yet resident first loads the base (its checkpoint's bytes in the job's dtype).
Activations are the engine's business: it checkpoints them when a micro-batch would not fit
(lorarl.trainer.engines.memory).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from lorarl.common.errors import ResourceExhaustedError
from lorarl.trainer.engines.memory import dtype_bytes, free_device_bytes

FreeBytes = Callable[[str], int]
#: Gradients and Adam's two moments per byte of adapter, on top of the adapter itself.
TRAINING_STATE_PER_ADAPTER_BYTE = 3


#: What ``free_on`` says of a device it cannot ask (none present, no driver): no refusal here; building the
#: engine names the missing device.
UNKNOWN_FREE = 1 << 62


def free_on(device: str) -> int:
    """Bytes free now on a job's device ("cpu": the host's available memory)."""
    if device.split(":", 1)[0] == "cpu":
        return free_device_bytes("cpu")
    try:
        import torch

        return free_device_bytes(torch.device(device))
    except (ImportError, RuntimeError, AssertionError, AttributeError):
        return UNKNOWN_FREE


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def checkpoint_bytes(model_path: str, dtype: str) -> int:
    """The base's weights in ``dtype``: its safetensors files, scaled from the dtype they were saved in."""
    path = Path(model_path)
    stored = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    try:
        saved = json.loads((path / "config.json").read_text())
        saved_dtype = str(saved.get("dtype") or saved.get("torch_dtype") or "float32")
        factor = dtype_bytes(dtype) / dtype_bytes(saved_dtype)
    except (OSError, ValueError, KeyError):
        factor = 1.0
    return int(stored * factor)


def check_base_fits(model_path: str, dtype: str, device: str, free: FreeBytes, devices: int = 1) -> None:
    """Before loading a base no job holds yet: its share of the weights (split over ``devices``, a layer
    split) must fit what is free on the first device."""
    need, have = checkpoint_bytes(model_path, dtype) // max(1, devices), free(device)
    if need > have:
        raise ResourceExhaustedError(f"the base {model_path} needs {gib(need)} in {dtype} on {device}"
                                     + (f" (1/{devices} of it)" if devices > 1 else "") + ", which has "
                                     f"{gib(have)} free; delete a job on another base, or use a trainer with "
                                     "more memory")


def check_job_fits(adapter_bytes: int, base_jobs: int, device: str, free: FreeBytes) -> None:
    """After a job's adapter is on the base: its gradients and optimizer moments must fit too."""
    need, have = TRAINING_STATE_PER_ADAPTER_BYTE * adapter_bytes, free(device)
    if need > have:
        raise ResourceExhaustedError(f"the job's adapter ({gib(adapter_bytes)}) needs {gib(need)} more for its "
                                     f"gradients and optimizer moments on {device}, which has {gib(have)} free "
                                     f"beside the {base_jobs - 1} other job(s) on its base; lower trainer.lora.rank "
                                     "or its targets, or delete a job")
