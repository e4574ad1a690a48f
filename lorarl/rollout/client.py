"""Client helpers for RolloutService: the LoadWeights stream built from (name, tensor) pairs.

Packs tensors into buckets and chunks exactly as weight sync does (lorarl.weightsync.wire.payload and
.inline), so the replica verifies them the same way whichever path they took.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from lorarl.v1 import common_pb2, rollout_pb2
from lorarl.weightsync.wire.inline import DEFAULT_CHUNK_BYTES, iter_chunks
from lorarl.weightsync.wire.payload import build_manifest, pack

BUCKET_BYTES = 256 << 20


def load_weights_stream(job_id: str, version: int, tensors: Mapping[str, torch.Tensor], mode: int, fingerprint: str,
                        lora: common_pb2.LoraSpec | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                        bucket_bytes: int = BUCKET_BYTES) -> Iterator[rollout_pb2.LoadWeightsRequest]:
    """LoadWeights messages: the manifest (inline transport), then every bucket in chunks."""
    buckets = list(pack(sorted(tensors.items()), bucket_bytes=bucket_bytes))
    manifest = build_manifest(job_id=job_id, version=version, mode=mode, base_model_fingerprint=fingerprint,
                              buckets=buckets, lora=lora)
    manifest.transport.inline.chunk_bytes = chunk_bytes
    yield rollout_pb2.LoadWeightsRequest(manifest=manifest)
    for chunk in iter_chunks([(b.index, b.buffer) for b in buckets], chunk_bytes):
        yield rollout_pb2.LoadWeightsRequest(chunk=chunk)
