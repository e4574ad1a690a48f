"""Memory one process shares with others on a CPU host (issue "one base"): anonymous memory files.

A co-located job's shared base (its format: lorarl.contract.base_segment) lives in a memory file the launcher
creates (``memfd_create``): it has no name anywhere, each service gets its descriptor at spawn (``pass_fds``) and
maps it read-only, and the kernel frees it when the last process holding it exits. So a restarted service maps
the same copy again, and no shared segment can outlive the job, whatever signal ends the launcher (parent_watch
ends the services it started). Adapter versions reach a co-located rollout the same way: a memory file of the
trainer's that the rollout opens through ``/proc/<pid>/fd/<fd>``.

Accelerators: CUDA IPC of one device buffer is the mechanism there (lorarl.platform.cuda_ipc; not run on a GPU
yet); Ascend has none that lorarl uses (README: "not run").
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any


class SegmentError(ValueError):
    """A segment that is not a shared base, or not this model's."""


def create() -> int:
    """A new anonymous memory file for a shared base (its descriptor; the caller keeps it open for the job)."""
    return os.memfd_create("lorarl-shared-base")


def path_of(fd: int) -> str:
    """How a process that inherited ``fd`` names it."""
    return f"/proc/self/fd/{fd}"


def colocation_id(path: str | Path) -> str:
    """Names the shared base at ``path`` (this boot, its device and inode): two services with the same id map
    the same memory, so they may also hand each other memory files (SharedMemoryTransport)."""
    st = os.stat(path)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def write_buffers(buffers: list[Any]) -> tuple[int, int]:
    """A new memory file holding ``buffers`` (uint8 tensors or bytes) back to back: (its descriptor, its size).
    The caller keeps the descriptor open while receivers may map it, then closes it (the memory goes with the
    last mapping)."""
    sizes = [b.numel() if hasattr(b, "numel") else len(b) for b in buffers]
    total = sum(sizes)
    fd = os.memfd_create("lorarl-adapter")
    try:
        os.ftruncate(fd, max(total, 1))
        with mmap.mmap(fd, max(total, 1)) as out:
            offset = 0
            for buffer, size in zip(buffers, sizes, strict=True):
                raw = buffer.numpy().data if hasattr(buffer, "numpy") else buffer
                out[offset:offset + size] = raw
                offset += size
    except BaseException:
        os.close(fd)
        raise
    return fd, total


def read_buffers(pid: int, fd: int, sizes: list[int]) -> list[Any]:
    """The buffers another process put in its memory file ``fd`` (write_buffers), as read-only uint8 tensors over
    one mapping of it; SegmentError when it is gone or smaller than ``sizes`` say."""
    import warnings

    import torch

    path = f"/proc/{pid}/fd/{fd}"
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SegmentError(f"the sender's memory file {path} cannot be opened ({e.strerror}): the sender is gone "
                           "or not on this host") from None
    try:
        total = os.fstat(handle).st_size
        if total < sum(sizes):
            raise SegmentError(f"the sender's memory file holds {total} bytes, the manifest {sum(sizes)}")
        buffer = mmap.mmap(handle, total, prot=mmap.PROT_READ)
    finally:
        os.close(handle)
    out, offset = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for size in sizes:
            out.append(torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=offset) if size
                       else torch.empty(0, dtype=torch.uint8))
            offset += size
    return out
