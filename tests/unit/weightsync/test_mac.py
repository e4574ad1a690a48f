"""Keyed bucket hashes: bytes forged on the collective group are refused even when their xxh64 matches.

An attacker who sees a bucket on the (unauthenticated) transfer group can make other bytes with the
same xxh64; here that is modelled by rewriting the manifest's xxh64 checksums to the forged bytes',
which is what such a forgery achieves. The keyed BLAKE3 under the job's transfer key still fails."""

from __future__ import annotations

import pytest
import torch

from lorarl.v1 import common_pb2
from lorarl.weightsync.client.agent import verified_tensors, verify_pieces
from lorarl.weightsync.wire.payload import (
    MAC_ALGORITHM,
    PayloadError,
    build_manifest,
    checksum,
    pack,
    transfer_key,
    validate_manifest,
)

ADAPTER = common_pb2.SYNC_MODE_ADAPTER
KEY = transfer_key("the-services-token", "job")


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"layer.{i}.lora_A.weight", torch.randn(8, 40, generator=g)) for i in range(6)]


def signed(version: int = 3, key: bytes | None = KEY, bucket_bytes: int = 2048):
    buckets = list(pack(tensors(), bucket_bytes=bucket_bytes))
    manifest = build_manifest(job_id="job", version=version, mode=ADAPTER, base_model_fingerprint="fp",
                              buckets=buckets, key=key)
    return buckets, manifest


def forge(buckets, manifest: common_pb2.WeightManifest) -> list[torch.Tensor]:
    """Bucket 1 with one tensor's bytes changed, and the manifest's xxh64s made to match (a forgery)."""
    buffers = [b.buffer.clone() for b in buckets]
    spec = next(t for t in manifest.tensors if t.bucket == 1)
    buffers[1][spec.offset: spec.offset + 4] ^= 0x55
    spec.checksum = checksum(buffers[1][spec.offset: spec.offset + spec.nbytes])
    manifest.buckets[1].checksum = checksum(buffers[1])
    return buffers


def test_a_signed_payload_verifies_under_its_key() -> None:
    buckets, manifest = signed()
    assert len(buckets) > 2 and manifest.mac_algorithm == MAC_ALGORITHM
    validate_manifest(manifest)
    got = verified_tensors(manifest, [b.buffer for b in buckets], key=KEY)
    assert all(torch.equal(got[name], t) for name, t in tensors())


def test_bytes_forged_with_matching_xxh64_pass_the_checksums_but_not_the_keyed_hash() -> None:
    buckets, manifest = signed()
    buffers = forge(buckets, manifest)
    verified_tensors(manifest, buffers)  # xxh64 alone is fooled: this is what the MAC is for
    with pytest.raises(PayloadError, match="bucket 1: keyed hash mismatch"):
        verified_tensors(manifest, buffers, key=KEY)


def test_piecewise_verification_checks_the_keyed_hash_too() -> None:
    buckets, manifest = signed()
    buffers = forge(buckets, manifest)
    pieces = [(i, buffer, start, min(start + 100, buffer.numel()))
              for i, buffer in enumerate(buffers) for start in range(0, buffer.numel(), 100)]
    with pytest.raises(PayloadError, match="keyed hash mismatch"):
        verify_pieces(manifest, pieces, key=KEY)


def test_another_token_or_job_derives_another_key() -> None:
    buckets, manifest = signed()
    assert transfer_key("the-services-token", "job") == KEY  # every holder of the token derives the same
    for other in (transfer_key("another-token", "job"), transfer_key("the-services-token", "job2"),
                  transfer_key(None, "job")):
        assert other != KEY
        with pytest.raises(PayloadError, match="keyed hash mismatch"):
            verified_tensors(manifest, [b.buffer for b in buckets], key=other)


def test_a_bucket_replayed_from_another_version_is_refused() -> None:
    """The MAC binds version, mode and bucket index: an old version's signed bytes do not pass as a new one."""
    old_buckets, old = signed(version=3)
    _, new = signed(version=4)
    new.buckets[0].mac = old.buckets[0].mac  # even a MAC copied along with the bytes
    assert new.buckets[0].mac != signed(version=4)[1].buckets[0].mac
    with pytest.raises(PayloadError, match="bucket 0: keyed hash mismatch"):
        verified_tensors(new, [b.buffer for b in old_buckets], key=KEY)
    moved = signed()[1]
    moved.buckets[0].mac, moved.buckets[1].mac = moved.buckets[1].mac, moved.buckets[0].mac
    with pytest.raises(PayloadError, match="bucket 0: keyed hash mismatch"):
        verified_tensors(moved, [b.buffer for b in old_buckets], key=KEY)


def test_a_receiver_with_the_key_refuses_a_manifest_without_macs() -> None:
    buckets, manifest = signed(key=None)
    assert manifest.mac_algorithm == "" and not any(b.mac for b in manifest.buckets)
    verified_tensors(manifest, [b.buffer for b in buckets])  # a keyless check still works
    with pytest.raises(PayloadError, match="carries no keyed hash"):
        verified_tensors(manifest, [b.buffer for b in buckets], key=KEY)


@pytest.mark.parametrize("breakage, message", [
    (lambda m: setattr(m, "mac_algorithm", "md5"), "mac_algorithm must be"),
    (lambda m: setattr(m.buckets[1], "mac", m.buckets[1].mac[:16]), "32-byte mac"),
])
def test_malformed_macs_are_refused_by_validation(breakage, message: str) -> None:
    _, manifest = signed()
    breakage(manifest)
    with pytest.raises(PayloadError, match=message):
        validate_manifest(manifest)
