"""Inline transfer: buckets cut into gRPC chunks, and reassembled with every byte accounted for.

Shared by the service (UploadWeights in, FetchWeights out) and the agent (FetchWeights in), so a
short, overlapping or out-of-bounds stream is caught the same way on both sides.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from lorarl.v1 import common_pb2
from lorarl.weightsync.wire.payload import PayloadError, tensor_bytes

DEFAULT_CHUNK_BYTES = 1 << 20  # large gRPC messages stall on flow control; 1 MiB streams well


def iter_chunks(buffers: Iterable[tuple[int, torch.Tensor]], chunk_bytes: int = DEFAULT_CHUNK_BYTES
                ) -> Iterator[common_pb2.WeightChunk]:
    """WeightChunks covering each (bucket index, uint8 buffer) in order."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be >= 1")
    for index, buffer in buffers:
        raw = tensor_bytes(buffer)
        for offset in range(0, len(raw), chunk_bytes):
            yield common_pb2.WeightChunk(bucket=index, offset=offset, data=bytes(raw[offset: offset + chunk_bytes]))


class BucketAssembler:
    """Collects chunks of a manifest's buckets; `finish()` fails unless every byte arrived exactly once.

    A bucket's memory is taken when its first chunk arrives, not when the manifest declares it, and a
    manifest declaring more than ``max_bytes`` in all is refused before anything is allocated."""

    def __init__(self, manifest: common_pb2.WeightManifest, max_bytes: int | None = None) -> None:
        declared = sum(b.nbytes for b in manifest.buckets)
        if max_bytes is not None and declared > max_bytes:
            raise PayloadError(f"the manifest declares {declared} bytes; this receiver takes at most {max_bytes}")
        self.manifest = manifest
        self.sizes = [b.nbytes for b in manifest.buckets]
        self.buffers: list[torch.Tensor | None] = [None] * len(self.sizes)
        self._views: list[memoryview | None] = [None] * len(self.sizes)
        self.filled = [0] * len(self.sizes)
        self.received = 0

    def _buffer(self, bucket: int) -> torch.Tensor:
        buffer = self.buffers[bucket]
        if buffer is None:
            buffer = self.buffers[bucket] = torch.empty(self.sizes[bucket], dtype=torch.uint8)
            self._views[bucket] = memoryview(buffer.numpy())
        return buffer

    def add(self, chunk: common_pb2.WeightChunk) -> None:
        if chunk.bucket >= len(self.sizes):
            raise PayloadError(f"chunk for bucket {chunk.bucket}, manifest has {len(self.sizes)}")
        end = chunk.offset + len(chunk.data)
        if end > self.sizes[chunk.bucket]:
            raise PayloadError(f"chunk [{chunk.offset}, {end}) overflows bucket {chunk.bucket} "
                               f"({self.sizes[chunk.bucket]} bytes)")
        if chunk.offset != self.filled[chunk.bucket]:
            raise PayloadError(f"bucket {chunk.bucket}: chunk at offset {chunk.offset}, expected "
                               f"{self.filled[chunk.bucket]} (chunks must arrive in order, without gaps)")
        self._buffer(chunk.bucket)
        self._views[chunk.bucket][chunk.offset: end] = chunk.data  # type: ignore[index]  (one copy)
        self.filled[chunk.bucket] = end
        self.received += len(chunk.data)

    def complete(self) -> bool:
        return all(f == n for f, n in zip(self.filled, self.sizes, strict=True))

    def finish(self) -> list[torch.Tensor]:
        """The buckets, once complete; a short transfer raises PayloadError naming the first short bucket."""
        for i, (f, n) in enumerate(zip(self.filled, self.sizes, strict=True)):
            if f != n:
                raise PayloadError(f"bucket {i}: received {f} bytes, expected {n} (short transfer)")
        return [self._buffer(i) for i in range(len(self.sizes))]
