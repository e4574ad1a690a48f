"""A torch.distributed process group made only for weight transfer ("XCCL").

It is built directly on its own TCPStore (listening on the sender's address only, see
lorarl.common.tcp_store), apart from the default group, so a trainer that already
runs data parallel (its own default group) can still open one transfer group per sync. gloo on CPU,
nccl on CUDA, hccl on Ascend: the same code, the backend picked by name.

A bucket travels as a series of broadcasts of at most PIECE_BYTES (both sides derive the same
pieces from the bucket sizes in the manifest), two in flight at a time, so a receiver checks one
piece while the next is on the wire; a bucket stays the unit of packing and of the manifest.

Across hosts each rank must announce an address its peers can reach: `local_address` pins gloo's
device to it (gloo's default resolves the hostname, which inside a container or network namespace is
often unreachable or loopback). For nccl/hccl set NCCL_SOCKET_IFNAME / HCCL_IF_IP as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from lorarl.common.tcp_store import client_store, master_store
from lorarl.v1 import common_pb2
from lorarl.weightsync.wire.payload import PackedBucket

BACKENDS = ("gloo", "nccl", "hccl")
PIECE_BYTES = 64 << 20
#: Backend name <-> lorarl.v1.CollectiveBackend.
BACKEND_PROTO = {
    "gloo": common_pb2.COLLECTIVE_BACKEND_GLOO,
    "nccl": common_pb2.COLLECTIVE_BACKEND_NCCL,
    "hccl": common_pb2.COLLECTIVE_BACKEND_HCCL,
}
BACKEND_NAMES = {v: k for k, v in BACKEND_PROTO.items()}


def pieces(nbytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """The [start, end) byte ranges a bucket of `nbytes` travels in."""
    return [(start, min(start + piece_bytes, nbytes)) for start in range(0, nbytes, piece_bytes)]


def rendezvous_store(host: str, timeout_s: float = 120.0, port: int = 0) -> dist.TCPStore:
    """A master store listening on `host`:`port` only (0: any free port, read back from `.port`), reusable
    for many groups through distinct group names; the sender creates it before asking for a rendezvous."""
    return master_store(host, port, None, timeout_s)


def _process_group(backend: str, store: dist.Store, rank: int, world_size: int,
                   timeout: timedelta, local_address: str | None = None) -> dist.ProcessGroup:
    if backend == "gloo":
        if local_address is None:
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "hccl":  # Ascend; needs torch_npu and CANN. Untested here (no Ascend hardware).
        from lorarl.platform import hccl_process_group_class

        ProcessGroupHCCL = hccl_process_group_class()
        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, options)
    raise ValueError(f"collective backend must be one of {BACKENDS}, got {backend!r}")


class WeightTransferGroup:
    """One sender (source rank) broadcasting buckets to every receiver rank."""

    def __init__(self, backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, timeout_s: float = 120.0, device: str = "cpu", *,
                 local_address: str | None = None, store: dist.Store | None = None,
                 piece_bytes: int = PIECE_BYTES) -> None:
        """`store`: an existing store to rendezvous on (see rendezvous_store); otherwise rank 0 hosts
        a new one at master_address:master_port and the others connect to it. Every rank must use the
        same `piece_bytes` (tests shrink it)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.device = torch.device(device)
        self.piece_bytes = piece_bytes
        timeout = timedelta(seconds=timeout_s)
        if store is None and rank == 0:
            store = master_store(master_address, master_port, world_size, timeout_s)
        elif store is None:
            store = client_store(master_address, master_port, world_size, timeout_s)
        else:
            store.set_timeout(timeout)  # a shared store follows this group's rendezvous timeout
        self._store = store
        prefixed = dist.PrefixStore(f"lorarl/{group_name}", self._store)
        self._pg = _process_group(backend, prefixed, rank, world_size, timeout, local_address)

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)

    def send(self, buckets: Iterable[PackedBucket], src: int = 0) -> int:
        """Broadcasts each bucket piece by piece; the next bucket is packed while pieces are in flight."""
        pending: list[tuple[torch.Tensor, dist.Work]] = []
        sent = 0
        for bucket in buckets:
            buf = bucket.buffer.to(self.device, non_blocking=True)
            for start, end in pieces(buf.numel(), self.piece_bytes):
                piece = buf[start:end]
                pending.append((piece, self.broadcast(piece, src)))
                if len(pending) > 1:
                    pending.pop(0)[1].wait()
            sent += buf.numel()
        for _, work in pending:
            work.wait()
        return sent

    def receive_pieces(self, sizes: Sequence[int], src: int = 0,
                       device_buffers: dict[int, torch.Tensor] | None = None
                       ) -> Iterator[tuple[int, torch.Tensor, int, int]]:
        """(bucket index, CPU bucket buffer, start, end) as each piece lands, the next one already posted.
        ``device_buffers``, if given, is filled with the buckets as they landed on the group's device (the
        CPU copies are what checksums read; tensors can then be views into the device buffers)."""
        plan = [(i, start, end) for i, n in enumerate(sizes) for start, end in pieces(n, self.piece_bytes)]
        buffers: dict[int, torch.Tensor] = {} if device_buffers is None else device_buffers
        host: dict[int, torch.Tensor] = {}
        pending: tuple[int, int, int, dist.Work] | None = None
        for i, start, end in plan:
            if i not in buffers:
                buffers[i] = torch.empty(sizes[i], dtype=torch.uint8, device=self.device)
                host[i] = buffers[i] if self.device.type == "cpu" else torch.empty(sizes[i], dtype=torch.uint8)
            work = self.broadcast(buffers[i][start:end], src)
            if pending is not None:
                yield self._landed(pending, buffers, host)
            pending = (i, start, end, work)
        if pending is not None:
            yield self._landed(pending, buffers, host)

    @staticmethod
    def _landed(pending: tuple[int, int, int, dist.Work], buffers: dict[int, torch.Tensor],
                host: dict[int, torch.Tensor]) -> tuple[int, torch.Tensor, int, int]:
        i, start, end, work = pending
        work.wait()
        if host[i] is not buffers[i]:
            host[i][start:end] = buffers[i][start:end].cpu()
        return i, host[i], start, end

    def receive_all(self, sizes: Sequence[int], src: int = 0) -> Iterator[torch.Tensor]:
        """Whole buckets in order (for callers that do not verify piece by piece)."""
        for i, buffer, _, end in self.receive_pieces(sizes, src):
            if end == sizes[i]:
                yield buffer

    def receive(self, nbytes: int, src: int = 0) -> torch.Tensor:
        """Receives one bucket of a known size (from the manifest)."""
        return next(iter(self.receive_all([nbytes], src)))

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device), 0).wait()

    def close(self, wait: bool = True) -> None:
        """Releases the group's connections now (not at garbage collection). A gloo shutdown takes
        ~20 ms whatever was sent; with ``wait=False`` it runs in a daemon thread, so a finished
        transfer does not hold up the sync that follows it."""
        pg, self._pg = self._pg, None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]
        if pg is None:
            return
        if wait:
            _shutdown(pg)
            return
        holder = [pg]
        del pg  # the closer thread must hold the only reference: see _release
        closer = threading.Thread(target=_release, args=(holder,), name="lorarl-group-close", daemon=True)
        with _CLOSING_LOCK:
            _CLOSING.difference_update([c for c in _CLOSING if not c.is_alive()])  # ended: nothing to wait for
            _CLOSING.add(closer)
            closer.start()  # under the lock: wait_closed never sees a thread it cannot join yet


#: Groups being shut down in the background. A process that exits while one is being shut down *or
#: destroyed* (gloo joins its threads in the destructor) is aborted by the C++ runtime ("terminate called
#: without an active exception"), so exits wait for these threads to end (wait_closed, at exit too).
_CLOSING: set[threading.Thread] = set()
_CLOSING_LOCK = threading.Lock()


def _shutdown(pg: dist.ProcessGroup) -> None:
    if hasattr(pg, "shutdown"):
        with contextlib.suppress(RuntimeError):  # already broken (a peer died): nothing to release
            pg.shutdown()


def _release(holder: list[dist.ProcessGroup]) -> None:
    """Shuts the group down and drops its last reference in this thread, so the group is destroyed
    before the thread ends and a join on the thread covers both."""
    _shutdown(holder.pop())


def wait_closed(timeout_s: float = 10.0) -> bool:
    """Waits for the groups closing in the background to be shut down and destroyed; True when none is
    left. Call before a process may exit (a publisher's close does; so does an atexit hook)."""
    deadline = time.monotonic() + timeout_s
    with _CLOSING_LOCK:
        pending = list(_CLOSING)
    for closer in pending:
        closer.join(max(0.0, deadline - time.monotonic()))
    with _CLOSING_LOCK:
        _CLOSING.difference_update(c for c in pending if not c.is_alive())
        return not _CLOSING


atexit.register(wait_closed)
