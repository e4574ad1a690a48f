"""The LoadWeights client stream: a manifest, then its bytes in chunks, checked like weight sync checks them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from lorarl.common.errors import InvalidArgumentError
from lorarl.common.validation import check_id, check_version
from lorarl.v1 import common_pb2, rollout_pb2
from lorarl.weightsync.wire.inline import BucketAssembler
from lorarl.weightsync.wire.payload import PayloadError, unpack_bucket, validate_manifest


async def receive(stream: AsyncIterator[rollout_pb2.LoadWeightsRequest], max_bytes: int | None = None
                  ) -> tuple[common_pb2.WeightManifest, dict[str, torch.Tensor]]:
    """The manifest and its verified tensors (views into the received buffers: copy what must outlive them).
    A manifest declaring more than ``max_bytes`` is refused before any memory is taken for it."""
    first = await anext(aiter(stream), None)
    if first is None or first.WhichOneof("payload") != "manifest":
        raise InvalidArgumentError("manifest", "the first LoadWeights message must carry the manifest")
    manifest = first.manifest
    try:
        validate_manifest(manifest)
    except PayloadError as exc:
        raise InvalidArgumentError("manifest", str(exc)) from None
    check_id("manifest.job_id", manifest.job_id)  # it names adapters and their files
    check_version("manifest.version", manifest.version, minimum=1)
    try:
        assembler = BucketAssembler(manifest, max_bytes)
    except PayloadError as exc:
        raise InvalidArgumentError("manifest", str(exc)) from None
    index = 0
    async for message in stream:
        index += 1
        if message.WhichOneof("payload") != "chunk":
            raise InvalidArgumentError(f"messages[{index}]", "only the first message may carry a manifest")
        try:
            assembler.add(message.chunk)
        except PayloadError as exc:
            raise InvalidArgumentError(f"messages[{index}].chunk", str(exc)) from None
    try:
        tensors: dict[str, torch.Tensor] = {}
        for bucket, buffer in enumerate(assembler.finish()):
            tensors.update(unpack_bucket(manifest, bucket, buffer, verify=True))
    except PayloadError as exc:
        raise InvalidArgumentError("chunk", str(exc)) from None
    return manifest, tensors
