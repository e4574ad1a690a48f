"""The trainer's accelerator specifics: binding a rank to its device, and the accelerator RNG states a bit-exact
resume needs (which torch module drives a device type is lorarl.platform's).

CUDA and Ascend NPU (torch_npu registers `torch.npu`, with the same device/RNG API as `torch.cuda`)
differ here only in the module. The NPU path is UNTESTED on hardware: CPU tests run it against a
stand-in module (tests/unit/trainer/test_devices.py); bench/npu_check.py runs it on a 910B.
"""

from __future__ import annotations

from typing import Any

import torch

from lorarl.platform import ACCELERATORS, accelerator


def bind_device(device: str) -> None:
    """Makes ``device`` (``cuda:N``/``npu:N``) this process's current one: nccl and hccl bind each
    rank's communicator to it, and kernels launched without a device go there."""
    kind, _, index = device.partition(":")
    module = accelerator(kind) if index else None
    if module is not None:
        module.set_device(int(index))


def capture_accelerator_rng(device: torch.device, module: Any = None) -> dict[str, torch.Tensor]:
    """Every device's generator state of the accelerator the job runs on, keyed torch_<type>_<index>."""
    module = module or accelerator(device.type)
    if module is None:
        return {}
    return {f"torch_{device.type}_{i}": state for i, state in enumerate(module.get_rng_state_all())}


def restore_accelerator_rng(tensors: dict[str, torch.Tensor], modules: dict[str, Any] | None = None) -> list[str]:
    """Restores the states capture_accelerator_rng saved, for each accelerator present; returns which."""
    restored = []
    for kind in ACCELERATORS:
        prefix = f"torch_{kind}_"
        states = [t for _, t in sorted((int(k[len(prefix):]), t) for k, t in tensors.items() if k.startswith(prefix))]
        module = (modules or {}).get(kind) or (accelerator(kind) if states else None)
        if states and module is not None:
            module.set_rng_state_all(states)
            restored.append(kind)
    return restored
