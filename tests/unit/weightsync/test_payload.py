"""Packing tensors into buckets, manifests, and detection of every kind of bad payload."""

from __future__ import annotations

import pytest
import torch

from lorarl.v1 import common_pb2
from lorarl.weightsync.wire.payload import (
    PayloadError,
    build_manifest,
    manifest_digest,
    pack,
    unpack_bucket,
    validate_manifest,
    verify_bucket,
)


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(7):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        out.append((f"layer.{i}.weight", torch.randn(33, 5 + i, generator=g).to(dtype)))
    return out


def packed(bucket_bytes: int = 1024):
    buckets = list(pack(named_tensors(), bucket_bytes=bucket_bytes))
    manifest = build_manifest(job_id="job", version=3, mode=common_pb2.SYNC_MODE_ADAPTER,
                              base_model_fingerprint="fp", buckets=buckets)
    return buckets, manifest


def test_round_trip_all_dtypes_across_buckets() -> None:
    buckets, manifest = packed()
    assert len(buckets) > 2
    validate_manifest(manifest)
    got = {name: t.clone() for b in buckets for name, t in unpack_bucket(manifest, b.index, b.buffer)}
    for name, tensor in named_tensors():
        assert got[name].dtype == tensor.dtype
        assert torch.equal(got[name], tensor), name
    assert manifest.total_bytes == sum(b.buffer.numel() for b in buckets)


def test_oversized_tensor_gets_its_own_bucket() -> None:
    big = [("a", torch.zeros(10)), ("b", torch.zeros(1000)), ("c", torch.zeros(10))]
    buckets = list(pack(big, bucket_bytes=256))
    assert [[s.name for s in b.specs] for b in buckets] == [["a"], ["b"], ["c"]]


def test_corrupted_bucket_is_rejected() -> None:
    buckets, manifest = packed()
    bad = buckets[1].buffer.clone()
    bad[5] ^= 0xFF
    with pytest.raises(PayloadError, match="checksum mismatch"):
        verify_bucket(manifest, 1, bad)


def test_truncated_bucket_is_rejected() -> None:
    buckets, manifest = packed()
    with pytest.raises(PayloadError, match="expected"):
        verify_bucket(manifest, 0, buckets[0].buffer[:-8])


@pytest.mark.parametrize("breakage, message", [
    (lambda m: m.tensors[0].shape.append(2), "does not match shape"),
    (lambda m: setattr(m, "total_bytes", m.total_bytes + 1), "total_bytes"),
    (lambda m: m.tensors.append(m.tensors[0]), "duplicate"),
    (lambda m: setattr(m.tensors[1], "offset", 10**9), "does not fit"),
    (lambda m: setattr(m, "mode", common_pb2.SYNC_MODE_AUTO), "ADAPTER or MERGED"),
    (lambda m: setattr(m, "checksum_algorithm", "md5"), "checksum_algorithm"),
])
def test_inconsistent_manifests_are_rejected(breakage, message: str) -> None:
    _, manifest = packed()
    breakage(manifest)
    with pytest.raises(PayloadError, match=message):
        validate_manifest(manifest)


def test_digest_identifies_content() -> None:
    _, a = packed()
    _, b = packed(bucket_bytes=4096)
    assert manifest_digest(a) == manifest_digest(b)  # same tensors, other bucketing
    a.tensors[0].checksum ^= 1
    assert manifest_digest(a) != manifest_digest(b)
