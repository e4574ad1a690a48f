"""Bytes between trainer ranks over a dedicated gloo group: commands out from rank 0, statuses back.

Commands never share the engines' default group (nccl on GPUs): a separate gloo group carries
them as uint8 tensors, so a command is a CPU collective that cannot interleave with, or wait
behind, the engines' device collectives. Each message is its length (an int64 broadcast) and
then its bytes; statuses are all-gathered the same way, an empty status meaning success.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: A status longer than this is cut (error texts only; the cut is marked).
MAX_STATUS_BYTES = 8192


def _to_tensor(data: bytes, size: int) -> torch.Tensor:
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer


class ControlChannel:
    """Rank 0 broadcasts command bytes; every rank then all-gathers its status text."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    def broadcast(self, data: bytes | None = None) -> bytes:
        """Rank 0 passes the bytes, the others receive them; every rank returns them."""
        length = torch.tensor([len(data) if self.rank == 0 and data is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.group)
        buffer = _to_tensor(data if self.rank == 0 and data is not None else b"", int(length.item()))
        dist.broadcast(buffer, src=0, group=self.group)
        return bytes(buffer.numpy().tobytes())

    def gather_status(self, status: str) -> list[str]:
        """Every rank's status text, by rank ('' = ok)."""
        data = status.encode()
        if len(data) > MAX_STATUS_BYTES:
            data = data[: MAX_STATUS_BYTES - 16] + b" ...[truncated]"
        length = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(lengths, length, group=self.group)
        sizes = [int(t.item()) for t in lengths]
        longest = max(sizes)
        if longest == 0:
            return [""] * self.world_size
        buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(buffers, _to_tensor(data, longest), group=self.group)
        return [b[:n].numpy().tobytes().decode(errors="replace") for b, n in zip(buffers, sizes, strict=True)]
