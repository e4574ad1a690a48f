"""Device kinds, their collective backends and the accelerator modules behind them.

``cpu``, ``cuda`` and ``npu`` (Ascend, through torch_npu, which gives ``torch.npu`` the same device, memory and
RNG API as ``torch.cuda``). A device string is ``KIND`` or ``KIND:INDEX``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

#: The collective backend each device kind's ranks join (trainer data parallelism and weight sync alike).
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
ACCELERATORS = ("cuda", "npu")


def device_kind(device: str) -> str:
    """``cuda`` for ``cuda:1``; the part before the index."""
    return device.split(":", 1)[0]


def backend_for(device: str) -> str:
    """gloo on CPU, nccl on CUDA, hccl on Ascend; KeyError for a device kind lorarl does not run on."""
    return BACKENDS[device_kind(device)]


def load_npu() -> bool:
    """Imports torch_npu (it registers ``torch.npu``, the "npu" device and hccl): False where it is not
    installed. The only import of torch_npu in lorarl."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return True


def accelerator(kind: str) -> ModuleType | None:
    """torch.cuda / torch.npu when that accelerator is usable in this process, else None."""
    import torch

    if kind == "npu" and not load_npu():
        return None
    module = getattr(torch, kind, None) if kind in ACCELERATORS else None
    return module if module is not None and module.is_available() else None


def torch_device(name: str) -> Any:
    """The torch device for ``name``, with torch_npu loaded first for Ascend (ImportError naming it when absent)."""
    import torch

    if device_kind(name) == "npu" and not load_npu():
        raise ImportError(f"device {name!r} needs torch_npu (Ascend's CANN stack), which is not installed")
    return torch.device(name)


def hccl_process_group_class() -> Any:
    """torch_npu's ProcessGroupHCCL (Ascend's collective backend; untested here, no Ascend hardware)."""
    if not load_npu():
        raise ImportError("the hccl backend needs torch_npu (Ascend's CANN stack), which is not installed")
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    return ProcessGroupHCCL
