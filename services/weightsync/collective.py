"""A torch.distributed process group made only for weight transfer ("XCCL").

It is built directly on its own TCPStore, apart from the default group, so a trainer that already
runs data parallel (its own default group) can still open one transfer group per sync. gloo on CPU,
nccl on CUDA, hccl on Ascend: the same code, the backend picked by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from services.weightsync.payload import PackedBucket

BACKENDS = ("gloo", "nccl", "hccl")


def _process_group(backend: str, store: dist.Store, rank: int, world_size: int,
                   timeout: timedelta) -> dist.ProcessGroup:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "hccl":  # Ascend; needs torch_npu and CANN. Untested here (no Ascend hardware).
        import torch_npu  # noqa: F401  (registers the npu device and ProcessGroupHCCL)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, options)
    raise ValueError(f"collective backend must be one of {BACKENDS}, got {backend!r}")


class WeightTransferGroup:
    """One sender (source rank) broadcasting buckets to every receiver rank."""

    def __init__(self, backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, timeout_s: float = 120.0, device: str = "cpu") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                    timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(f"lorarl/{group_name}", self._store)
        self._pg = _process_group(backend, prefixed, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)

    def send(self, buckets: Iterable[PackedBucket], src: int = 0) -> int:
        """Broadcasts each bucket; the next bucket is packed while the previous one is in flight."""
        pending: dist.Work | None = None
        sent = 0
        for bucket in buckets:
            buf = bucket.buffer.to(self.device, non_blocking=True)
            work = self.broadcast(buf, src)
            if pending is not None:
                pending.wait()
            pending, sent = work, sent + buf.numel()
        if pending is not None:
            pending.wait()
        return sent

    def receive(self, nbytes: int, src: int = 0) -> torch.Tensor:
        """Receives one bucket of a known size (from the manifest)."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.broadcast(buf, src).wait()
        return buf.cpu()

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device), 0).wait()

    def close(self) -> None:
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]
