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
    """Collects chunks of a manifest's buckets; `finish()` fails unless every byte arrived exactly once."""

    def __init__(self, manifest: common_pb2.WeightManifest) -> None:
        self.manifest = manifest
        self.buffers = [torch.empty(b.nbytes, dtype=torch.uint8) for b in manifest.buckets]
        self._views = [memoryview(b.numpy()) for b in self.buffers]
        self.filled = [0] * len(self.buffers)
        self.received = 0

    def add(self, chunk: common_pb2.WeightChunk) -> None:
        if chunk.bucket >= len(self.buffers):
            raise PayloadError(f"chunk for bucket {chunk.bucket}, manifest has {len(self.buffers)}")
        buffer = self.buffers[chunk.bucket]
        end = chunk.offset + len(chunk.data)
        if end > buffer.numel():
            raise PayloadError(f"chunk [{chunk.offset}, {end}) overflows bucket {chunk.bucket} "
                               f"({buffer.numel()} bytes)")
        if chunk.offset != self.filled[chunk.bucket]:
            raise PayloadError(f"bucket {chunk.bucket}: chunk at offset {chunk.offset}, expected "
                               f"{self.filled[chunk.bucket]} (chunks must arrive in order, without gaps)")
        self._views[chunk.bucket][chunk.offset: end] = chunk.data  # one copy, no temporaries
        self.filled[chunk.bucket] = end
        self.received += len(chunk.data)

    def complete(self) -> bool:
        return all(f == b.numel() for f, b in zip(self.filled, self.buffers, strict=True))

    def finish(self) -> list[torch.Tensor]:
        """The buckets, once complete; a short transfer raises PayloadError naming the first short bucket."""
        for i, (f, b) in enumerate(zip(self.filled, self.buffers, strict=True)):
            if f != b.numel():
                raise PayloadError(f"bucket {i}: received {f} bytes, expected {b.numel()} (short transfer)")
        return self.buffers
