"""Episodes that sample at the same moment share one Generate call.

A batch's episodes start together, and each asks the rollout for its own prompt's completions; sent one by
one, a step of the demo job is 16 calls where one would do, and on a 2-core machine each call's
validation and scheduling comes out of the engine's time (the demo's loop went from 15 s to 22 s). This
wrapper holds every Generate request made in one turn of the event loop and sends those that ask the same
policy with the same sampling settings as one request with many prompts; each caller gets its own prompt's
completions back. The merged request carries its first member's seed and request id: the batch's episodes
start in a fixed order, so a run is as reproducible as before.
"""

from __future__ import annotations

import asyncio

from lorarl.v1 import rollout_pb2

#: Most prompts merged into one request (the rollout's own bound on a request is larger).
MAX_PROMPTS = 256


class CoalescingRollout:
    """``Generate`` like the rollout stub it wraps, merging same-turn single-prompt calls."""

    def __init__(self, rollout: object) -> None:
        self.rollout = rollout
        self._pending: dict[bytes, list[tuple[rollout_pb2.GenerateRequest, asyncio.Future]]] = {}
        self._flushing: set[asyncio.Task[None]] = set()

    async def Generate(self, request: rollout_pb2.GenerateRequest, group: str = ""  # noqa: N802
                       ) -> rollout_pb2.GenerateResponse:
        """``group``: only calls of one group merge (the loop's batch), as one request per batch did before."""
        if len(request.prompts) != 1:
            return await self.rollout.Generate(request)
        sampling = rollout_pb2.GenerateRequest(sampling=request.sampling, policy=request.policy, request_id=group,
                                               teachers=request.teachers)
        sampling.sampling.ClearField("seed")
        base = sampling.SerializeToString(deterministic=True)
        # The merged request has one seed, and the engine seeds completions by their index within a prompt:
        # two calls for the same prompt would get the same completions. They go out in separate requests.
        prompt = tuple(request.prompts[0].token_ids)
        slot = 0
        while any(tuple(r.prompts[0].token_ids) == prompt and r.prompts[0].text == request.prompts[0].text
                  for r, _ in self._pending.get(base + slot.to_bytes(4, "big"), [])):
            slot += 1
        key = base + slot.to_bytes(4, "big")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        waiting = self._pending.setdefault(key, [])
        waiting.append((request, future))
        if len(waiting) == 1:
            asyncio.get_running_loop().call_soon(self._start_flush, key)
        elif len(waiting) >= MAX_PROMPTS:
            self._start_flush(key)
        return await future

    def _start_flush(self, key: bytes) -> None:
        task = asyncio.ensure_future(self._flush(key))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush(self, key: bytes) -> None:
        members = self._pending.pop(key, [])
        if not members:
            return
        first = members[0][0]
        merged = rollout_pb2.GenerateRequest(sampling=first.sampling, policy=first.policy, teachers=first.teachers,
                                             request_id=first.request_id,
                                             prompts=[request.prompts[0] for request, _ in members])
        try:
            response = await self.rollout.Generate(merged)
            if len(response.results) != len(members):
                raise RuntimeError(f"the rollout answered {len(response.results)} results for {len(members)} prompts")
        except BaseException as error:  # every member fails as its own call would have
            for _, future in members:
                if not future.done():
                    future.set_exception(error)
            return
        for i, ((_, future), result) in enumerate(zip(members, response.results, strict=True)):
            if not future.done():  # the scoring time counted once, on the first member
                future.set_result(rollout_pb2.GenerateResponse(
                    results=[result], teacher_seconds=response.teacher_seconds if i == 0 else 0.0))
