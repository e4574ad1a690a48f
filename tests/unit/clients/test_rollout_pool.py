"""Prompts split across rollout replicas come back whole and in order, each group from one replica."""

from __future__ import annotations

import asyncio

import pytest

from lorarl.client.rollout_pool import RolloutPool, split_evenly
from lorarl.v1 import rollout_pb2


class Replica:
    """A stand-in stub: answers each prompt with its own name and the prompt text."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[rollout_pb2.GenerateRequest] = []

    async def Generate(self, request, **kwargs):  # noqa: N802
        self.requests.append(request)
        await asyncio.sleep(0)
        return rollout_pb2.GenerateResponse(results=[
            rollout_pb2.PromptCompletions(completions=[rollout_pb2.Completion(text=f"{self.name}:{p.text}")
                                                       for _ in range(request.sampling.n)])
            for p in request.prompts])


def test_split_evenly() -> None:
    assert split_evenly(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_evenly(2, 4) == [(0, 1), (1, 2)]
    assert split_evenly(0, 2) == []


def test_pool_splits_and_restores_order() -> None:
    replicas = [Replica("a"), Replica("b"), Replica("c")]
    pool = RolloutPool(replicas)
    request = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text=str(i)) for i in range(7)],
                                          request_id="job-b3")
    request.sampling.n = 2
    response = asyncio.run(pool.Generate(request))
    texts = [r.completions[0].text for r in response.results]
    assert texts == ["a:0", "a:1", "a:2", "b:3", "b:4", "c:5", "c:6"]
    assert all(len(r.completions) == 2 for r in response.results)  # a whole group per prompt
    assert [r.request_id for rep in replicas for r in rep.requests] == ["job-b3-r0", "job-b3-r1", "job-b3-r2"]
    assert all(r.sampling.n == 2 for rep in replicas for r in rep.requests)


def test_single_replica_passes_through_and_empty_pool_is_refused() -> None:
    replica = Replica("only")
    request = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="x")], request_id="r")
    asyncio.run(RolloutPool([replica]).Generate(request))
    assert replica.requests[0].request_id == "r"
    with pytest.raises(ValueError):
        RolloutPool([])
