"""Platform facts in one place (as vLLM keeps its ``platforms/``): which device kinds exist, the collective
backend each one needs, and the one import of ``torch_npu`` (Ascend registers ``torch.npu`` and hccl only once it
is imported). Services and engines ask here instead of testing device strings or importing vendor modules
themselves; the memory one process shares with another (issue "one base") is here too: memory files on a CPU host
(``shared_memory``), CUDA IPC of a device buffer (``cuda_ipc``).

The Ascend path is written for and checked by source only (no Ascend card in CI): README says "not run".
"""

from lorarl.platform.devices import (
    ACCELERATORS,
    BACKENDS,
    accelerator,
    backend_for,
    device_kind,
    hccl_process_group_class,
    load_npu,
    torch_device,
)

__all__ = ["ACCELERATORS", "BACKENDS", "accelerator", "backend_for", "device_kind", "hccl_process_group_class",
           "load_npu", "torch_device"]
