"""Several rollout replicas behind the one `Generate` call the RL loop makes.

Each replica is its own rollout service (its own vLLM engine, devices, maybe its own node), all
following the same weight-sync service, which activates a version on every replica before the
trainer's publish returns. The pool splits a request's prompts into contiguous slices, one per
replica, sends them concurrently and stitches the results back in prompt order, so a GRPO group
(one prompt, n completions) always comes from one replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from lorarl.v1 import rollout_pb2


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) slices of ``count`` items, sizes differing by at most one;
    empty slices are dropped."""
    size, extra = divmod(count, parts)
    slices, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        if end > start:
            slices.append((start, end))
        start = end
    return slices


class RolloutPool:
    """Duck-types the parts of RolloutServiceStub the loop uses (``Generate``) over N replicas."""

    def __init__(self, stubs: Sequence[object]) -> None:
        if not stubs:
            raise ValueError("a rollout pool needs at least one replica")
        self.stubs = list(stubs)

    async def Generate(self, request: rollout_pb2.GenerateRequest, **kwargs) -> rollout_pb2.GenerateResponse:  # noqa: N802
        if len(self.stubs) == 1:
            return await self.stubs[0].Generate(request, **kwargs)
        slices = split_evenly(len(request.prompts), len(self.stubs))

        async def one(replica: int, start: int, end: int) -> rollout_pb2.GenerateResponse:
            part = rollout_pb2.GenerateRequest()
            part.CopyFrom(request)
            del part.prompts[:]
            part.prompts.extend(request.prompts[start:end])
            if request.request_id:
                part.request_id = f"{request.request_id}-r{replica}"
            return await self.stubs[replica].Generate(part, **kwargs)

        parts = await asyncio.gather(*(one(i, start, end) for i, (start, end) in enumerate(slices)))
        merged = rollout_pb2.GenerateResponse()
        merged.CopyFrom(parts[0])
        for part in parts[1:]:
            merged.results.extend(part.results)
        return merged
