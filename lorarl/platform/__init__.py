"""Platform facts in one place (as vLLM keeps its ``platforms/``): which device kinds exist, the collective
backend each one needs, and the one import of ``torch_npu`` (Ascend registers ``torch.npu`` and hccl only once it
is imported). Services and engines ask here instead of testing device strings or importing vendor modules
themselves; the shared-memory handoff of issue "one base" adds its per-platform mechanism here too.

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
