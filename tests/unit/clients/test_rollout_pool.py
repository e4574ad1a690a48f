"""Prompts split across rollout replicas come back whole and in order, each group from one replica."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from lorarl.client.calls import ServiceCallError
from lorarl.client.rl.rollout_pool import RolloutPool, split_evenly
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


class Dead(Replica):
    """A replica whose process is gone: every call fails as a killed server's does."""

    def __init__(self, name: str, code=None) -> None:
        super().__init__(name)
        import grpc

        self.code = code or grpc.StatusCode.UNAVAILABLE

    async def Generate(self, request, **kwargs):  # noqa: N802
        from lorarl.client.calls import ServiceCallError

        self.requests.append(request)
        raise ServiceCallError("rollout", self.name, "Generate", self.code, "Socket closed")


def prompts(count: int) -> rollout_pb2.GenerateRequest:
    request = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text=str(i)) for i in range(count)],
                                          request_id="job-b1")
    request.sampling.n = 1
    return request


def test_a_dead_replicas_prompts_are_redone_on_the_others_in_order() -> None:
    live, dead, other = Replica("a"), Dead("b"), Replica("c")
    pool = RolloutPool([live, dead, other])
    response = asyncio.run(pool.Generate(prompts(6)))
    texts = [r.completions[0].text for r in response.results]
    # b's slice (2, 3) went to a and c on the second attempt; every prompt answered once, in order.
    assert [t.split(":")[1] for t in texts] == [str(i) for i in range(6)]
    assert texts[2:4] == ["a:2", "c:3"]
    assert [r.request_id for r in live.requests] == ["job-b1-r0", "job-b1-a1r0"]
    usage, redone = pool.take_usage()
    assert redone == 2 and usage == {"replica-0": 3, "replica-2": 3}
    # The failed replica is set aside: the next call does not try it.
    asyncio.run(pool.Generate(prompts(2)))
    assert len(dead.requests) == 1


def test_request_errors_are_not_redone_and_a_lone_dead_replica_fails_the_call() -> None:
    import grpc

    from lorarl.client.calls import ServiceCallError

    pool = RolloutPool([Replica("a"), Dead("b", grpc.StatusCode.INVALID_ARGUMENT)])
    with pytest.raises(ServiceCallError, match="INVALID_ARGUMENT"):
        asyncio.run(pool.Generate(prompts(4)))
    with pytest.raises(ServiceCallError, match="UNAVAILABLE"):  # nowhere to redo: the loop's recovery decides
        asyncio.run(RolloutPool([Dead("x")]).Generate(prompts(2)))
    both = RolloutPool([Dead("x"), Dead("y")])
    with pytest.raises(ServiceCallError, match="UNAVAILABLE"):
        asyncio.run(both.Generate(prompts(2)))
    with pytest.raises(ServiceCallError, match="every rollout replica failed"):  # both set aside now
        asyncio.run(both.Generate(prompts(2)))


def test_discovered_fleet_joins_once_caught_up_and_drops_leavers() -> None:
    from lorarl.client.rl.rollout_pool import Fleet, FleetReplica

    stubs = {"h:1": Replica("one"), "h:2": Replica("two")}
    fleet = Fleet(3, (FleetReplica("one", "h:1", 3),))

    async def discover():
        return fleet

    async def connect(address):
        return stubs[address]

    async def scenario() -> list[int]:
        nonlocal fleet
        pool = RolloutPool(discover=discover, connect=connect, refresh_s=0)
        await pool.wait_members(1)
        seen = [len(pool.live())]
        fleet = Fleet(3, (*fleet.replicas, FleetReplica("two", "h:2", 0)))  # joined, not caught up yet
        await pool.Generate(prompts(4))
        seen.append(len(pool.live()))
        fleet = Fleet(3, (fleet.replicas[0], FleetReplica("two", "h:2", 3)))  # caught up: used at once
        await pool.Generate(prompts(4))
        seen.append(len(pool.live()))
        assert pool.take_usage()[0] == {"one": 6, "two": 2}
        fleet = Fleet(4, (FleetReplica("two", "h:2", 4),))  # one left
        await pool.Generate(prompts(2))
        seen.append(len(pool.live()))
        assert pool.take_usage()[0] == {"two": 2}
        fleet = Fleet(4, ())
        with pytest.raises(RuntimeError, match="no rollout replica serves the job"):
            await pool.wait_members(0.1)
        return seen

    assert asyncio.run(scenario()) == [1, 1, 2, 1]


class Busy(Replica):
    """A replica whose admission limit is taken by other requests for its first ``busy_for`` asks."""

    def __init__(self, name: str, busy_for: int) -> None:
        super().__init__(name)
        self.busy_for, self.asks = busy_for, 0

    async def Generate(self, request, **kwargs):  # noqa: N802
        self.asks += 1
        if self.asks <= self.busy_for:
            raise ServiceCallError("rollout", self.name, "Generate", grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   "1000 sequences in flight and this request adds 128; the limit is 1024 "
                                   "(rollout.max_queued_requests): retry later")
        return await super().Generate(request, **kwargs)


def test_a_busy_replica_is_asked_again_until_it_has_room_and_no_longer_than_busy_wait_s() -> None:
    request = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="x")], request_id="job-b1")
    request.sampling.n = 1
    replica = Busy("shared", busy_for=3)
    pool = RolloutPool([replica])
    response = asyncio.run(pool.Generate(request))
    assert response.results[0].completions[0].text == "shared:x" and replica.asks == 4
    assert pool.take_busy_waits() == 3 and pool.take_busy_waits() == 0
    # each replica on its own (the policy guard's probe) waits the same way
    probed = RolloutPool([Busy("probed", busy_for=2)])
    [(_, replica_alone)] = probed.each_replica()
    assert asyncio.run(replica_alone.Generate(request)).results[0].completions[0].text == "probed:x"
    assert probed.take_busy_waits() == 2
    # a replica that stays busy: its error reaches the loop once busy_wait_s is spent
    stuck = RolloutPool([Busy("stuck", busy_for=10**6)], busy_wait_s=0.3)
    started = time.monotonic()
    with pytest.raises(ServiceCallError) as raised:
        asyncio.run(stuck.Generate(request))
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - started < 2.0
    # any other refusal is not waited on
    refusing = Refusing("x")
    with pytest.raises(ServiceCallError):
        asyncio.run(RolloutPool([refusing]).Generate(request))
    assert refusing.asks == 1


class Refusing(Replica):
    """A replica that refuses the request itself (one that can never fit)."""

    asks = 0

    async def Generate(self, request, **kwargs):  # noqa: N802
        self.asks += 1
        raise ServiceCallError("rollout", self.name, "Generate", grpc.StatusCode.INVALID_ARGUMENT, "split it")
