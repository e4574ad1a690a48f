"""Device memory one process shares with another on the same GPU (issue "one base"): CUDA IPC.

A process exports one device buffer by handle: torch's own CUDA IPC (the storage's ``_share_cuda_``, what
``torch.multiprocessing`` sends when a CUDA tensor crosses processes), written out as plain JSON, never pickled. A
process on the same GPU opens the handle as a tensor over the very same device memory: no copy, one allocation on
the card (nvidia-smi and ``torch.cuda.mem_get_info`` see it once). The exporter must keep the buffer alive while
any other process uses it; in lorarl that is the holder of the shared base (as on CPU, where the launcher holds the
memory file: lorarl.platform.shared_memory).

Run on one GPU by bench/one_base_gpu.py (its table: bench/RESULTS.md, once a GPU is lent); on CPU nothing here
runs (the CPU mechanism is the memory file). Ascend: torch_npu offers no equivalent that lorarl uses (README:
"not run").
"""

from __future__ import annotations

import base64
import os
import weakref
from typing import Any

FORMAT = "lorarl-cuda-ipc-1"
#: The buffers this process exported, by handle: CUDA cannot open a process's own IPC handle
#: (cudaIpcOpenMemHandle: invalid device context), and torch's storage cache does not catch it (it stores the
#: exporter's storage under another key than its rebuild looks up), so the exporter is given its own tensor back.
_EXPORTED: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode("ascii")


def _raw(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def export_buffer(buffer: Any) -> dict[str, Any]:
    """A JSON-able handle for ``buffer``, a contiguous 1-D uint8 CUDA tensor: the arguments torch's own
    ``reduce_tensor`` gives ``rebuild_cuda_tensor``, with the classes (always a plain tensor over a typed storage)
    left out and the byte strings in base64."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1 or \
            not buffer.is_contiguous():
        raise ValueError(f"export_buffer takes a contiguous 1-D uint8 CUDA tensor, got {buffer.dtype} "
                         f"{list(buffer.shape)} on {buffer.device}")
    rebuild, args = reduce_tensor(buffer.detach())
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"torch shares this tensor by {rebuild.__name__}, not CUDA IPC")
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_counter,
     ref_counter_offset, event, event_sync) = args
    _EXPORTED[_text(handle)] = buffer
    return {"format": FORMAT, "pid": os.getpid(), "size": list(size), "stride": list(stride), "offset": int(offset),
            "device": int(device), "handle": _text(handle), "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset), "ref_counter": _text(ref_counter),
            "ref_counter_offset": int(ref_counter_offset), "event": _text(event), "event_sync": bool(event_sync)}


def open_buffer(handle: dict[str, Any]) -> Any:
    """The exported buffer in this process: a uint8 tensor over the same device memory (torch's
    ``rebuild_cuda_tensor``, as ``torch.multiprocessing`` would call it; in the exporting process itself, the
    exported tensor). ValueError for a handle that is not one."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not isinstance(handle, dict) or handle.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} handle: {str(handle)[:80]}")
    if handle.get("pid") == os.getpid():  # this process's own export: its tensor, while it holds it
        own = _EXPORTED.get(handle.get("handle", ""))
        if own is None:
            raise ValueError("this process exported the handle but no longer holds its buffer")
        return own
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(handle["size"]), tuple(handle["stride"]), handle["offset"],
            torch.storage.TypedStorage, torch.uint8, handle["device"], _raw(handle["handle"]),
            handle["storage_bytes"], handle["storage_offset"], False, _raw(handle["ref_counter"]),
            handle["ref_counter_offset"], _raw(handle["event"]), handle["event_sync"])
    except KeyError as e:
        raise ValueError(f"the {FORMAT} handle lacks {e}") from None
