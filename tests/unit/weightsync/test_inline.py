"""Inline chunks reassemble exactly; a short, overlapping or out-of-bounds stream is refused."""

from __future__ import annotations

import pytest
import torch

from lorarl.v1 import common_pb2
from lorarl.weightsync.client.agent import verified_tensors, verify_pieces
from lorarl.weightsync.wire.inline import BucketAssembler, iter_chunks
from lorarl.weightsync.wire.payload import PayloadError
from tests.unit.weightsync.fixtures import adapter, manifest_of


def chunks(chunk_bytes: int = 100):
    manifest, buckets = manifest_of(adapter(), bucket_bytes=600)
    return manifest, list(iter_chunks(((b.index, b.buffer) for b in buckets), chunk_bytes))


def test_chunks_reassemble_to_verified_tensors() -> None:
    manifest, parts = chunks()
    assert len(manifest.buckets) > 1 and len(parts) > len(manifest.buckets)
    assembler = BucketAssembler(manifest)
    for part in parts:
        assembler.add(part)
    tensors = verified_tensors(manifest, assembler.finish())
    want = adapter()
    assert tensors.keys() == want.keys()
    assert all(t.equal(want[n]) for n, t in tensors.items())
    assert assembler.received == manifest.total_bytes


def test_short_transfer_is_refused() -> None:
    manifest, parts = chunks()
    assembler = BucketAssembler(manifest)
    for part in parts[:-1]:
        assembler.add(part)
    with pytest.raises(PayloadError, match="short transfer"):
        assembler.finish()


def test_gaps_overlaps_and_overflow_are_refused() -> None:
    manifest, parts = chunks()
    assembler = BucketAssembler(manifest)
    assembler.add(parts[0])
    with pytest.raises(PayloadError, match="expected 100"):
        assembler.add(parts[2])  # skips parts[1]
    with pytest.raises(PayloadError, match="expected 100"):
        assembler.add(parts[0])  # repeats
    with pytest.raises(PayloadError, match="overflows"):
        assembler.add(common_pb2.WeightChunk(bucket=0, offset=100, data=b"x" * manifest.buckets[0].nbytes))
    with pytest.raises(PayloadError, match="manifest has"):
        assembler.add(common_pb2.WeightChunk(bucket=99, offset=0, data=b"x"))


def test_verification_rejects_flipped_byte_truncation_and_missing_buckets() -> None:
    manifest, buckets = manifest_of(adapter(), bucket_bytes=600)
    buffers = [b.buffer.clone() for b in buckets]
    buffers[1][5] ^= 1
    with pytest.raises(PayloadError, match="checksum mismatch"):
        verified_tensors(manifest, buffers)
    with pytest.raises(PayloadError, match="expected"):
        verified_tensors(manifest, [b.buffer for b in buckets], hook=lambda m, i, b: b[:-8] if i == 0 else b)
    with pytest.raises(PayloadError, match="short transfer"):
        verified_tensors(manifest, [b.buffer for b in buckets][:-1])


def test_verification_consumes_every_buffer_after_a_failure() -> None:
    manifest, buckets = manifest_of(adapter(), bucket_bytes=600)
    seen = []

    def buffers():
        for b in buckets:
            seen.append(b.index)
            yield b.buffer

    with pytest.raises(PayloadError):
        verified_tensors(manifest, buffers(), hook=lambda m, i, b: b[:-1] if i == 0 else b)
    assert seen == [b.index for b in buckets]  # a collective receiver keeps draining for its peers


def pieces_of(buckets, size: int):
    for b in buckets:
        n = b.buffer.numel()
        for start in range(0, n, size):
            yield b.index, b.buffer, start, min(start + size, n)


@pytest.mark.parametrize("piece", [1, 7, 64, 100_000])
def test_piecewise_verification_matches_whole_buckets(piece: int) -> None:
    manifest, buckets = manifest_of(adapter(), bucket_bytes=600)
    tensors = verify_pieces(manifest, pieces_of(buckets, piece))
    want = adapter()
    assert tensors.keys() == want.keys() and all(t.equal(want[n]) for n, t in tensors.items())


def test_piecewise_verification_catches_padding_order_and_size() -> None:
    odd = {"a": torch.randn(3), "b": torch.randn(5)}  # 12 bytes, then padding up to the 64-byte boundary
    odd_manifest, odd_buckets = manifest_of(odd, bucket_bytes=4096)
    padded = odd_buckets[0].buffer.clone()
    padded[20] = 7  # only the bucket checksum covers alignment padding
    assert verify_pieces(odd_manifest, [(0, odd_buckets[0].buffer, 0, padded.numel())]).keys() == odd.keys()
    with pytest.raises(PayloadError, match="bucket 0: checksum mismatch"):
        verify_pieces(odd_manifest, [(0, padded, 0, padded.numel())])
    manifest, buckets = manifest_of(adapter(), bucket_bytes=600)
    shuffled = list(pieces_of(buckets, 50))
    shuffled[0], shuffled[1] = shuffled[1], shuffled[0]
    with pytest.raises(PayloadError, match="out of order"):
        verify_pieces(manifest, shuffled)
    with pytest.raises(PayloadError, match="received 10 bytes"):
        verify_pieces(manifest, [(0, buckets[0].buffer[:10], 0, 10)])
