"""One stored version's payload, fetched whole from the weight-sync service by a client that is not a replica.

A replica receives versions as they are published (lorarl.weightsync.client.agent); a distilling job reads an older
one of another job once, as its teacher (lorarl.client.rl.teacher_versions): the manifest, then the inline chunks,
every bucket's checksum and (with the stack's token) its MAC verified as a replica verifies them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.wire.inline import BucketAssembler
from lorarl.weightsync.wire.payload import PayloadError, PayloadVerifier, transfer_key, validate_manifest


async def fetch_version(stub: Any, job_id: str, version: int, token: str | None
                        ) -> tuple[common_pb2.WeightManifest, dict[str, torch.Tensor]]:
    """``job_id``'s ``version`` (its manifest and tensors by name) from weight sync's ``FetchWeights``; PayloadError
    when the bytes do not match the manifest (a gRPC error from the stub as it is: NOT_FOUND for a version the
    service does not hold)."""
    assembler: BucketAssembler | None = None
    manifest: common_pb2.WeightManifest | None = None
    async for response in stub.FetchWeights(weightsync_pb2.FetchWeightsRequest(job_id=job_id, version=version)):
        if manifest is None:
            if not response.HasField("manifest"):
                raise PayloadError("FetchWeights sent a chunk before its manifest")
            manifest = response.manifest
            if (manifest.job_id, manifest.version) != (job_id, version):
                raise PayloadError(f"FetchWeights for {job_id} v{version} answered with {manifest.job_id} "
                                   f"v{manifest.version}")
            validate_manifest(manifest)
            assembler = BucketAssembler(manifest)
        else:
            assert assembler is not None
            assembler.add(response.chunk)
    if manifest is None or assembler is None:
        raise PayloadError(f"FetchWeights sent nothing for {job_id} v{version}")
    buffers = assembler.finish()

    def verify() -> dict[str, torch.Tensor]:
        verifier = PayloadVerifier(manifest, transfer_key(token, job_id))
        for index, buffer in enumerate(buffers):
            verifier.feed(index, buffer, 0, buffer.numel())
        return verifier.finish()

    tensors = await asyncio.to_thread(verify)
    return manifest, {name: t.clone() for name, t in tensors.items()}  # owned: the buffers go
