"""Several rollout replicas behind the one `Generate` call the RL loop makes.

Each replica is its own rollout service (its own vLLM engine, devices, maybe its own node), all
following the same weight-sync service, which activates a version on every replica before the
trainer's publish returns. The pool splits a request's prompts into contiguous slices, one per
replica, sends them concurrently and stitches the results back in prompt order, so a GRPO group
(one prompt, n completions) always comes from one replica.

The fleet may change under a run. With ``discover`` (lorarl.client.rl.fleet: the replicas weight sync
knows), the pool re-reads it at most every ``refresh_s``: a replica that joined is used once it
serves the job's active version; one that left is dropped. A replica whose call fails because it is
gone (UNAVAILABLE, CANCELLED) is set aside for ``quarantine_s`` and its prompts are redone on the
others in the same call; only when none is left does the error reach the loop (whose recovery waits
for a replica). A static list (``lorarl train --rollout``) gets the same redo, without discovery.

A replica that is busy (RESOURCE_EXHAUSTED: its admission limit, rollout.max_queued_requests, is taken by
other requests, e.g. other jobs sharing the fleet) is asked again after a short, growing pause, for at most
``busy_wait_s``; then its error reaches the loop. A request that can never fit is refused as
INVALID_ARGUMENT by the replica, so this wait only ever waits for room that frees.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from lorarl.client.calls import ServiceCallError
from lorarl.v1 import rollout_pb2

logger = logging.getLogger(__name__)

#: A replica's call failed because the replica is gone (killed, stopped, unreachable), not the request.
GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
REFRESH_S = 0.5
QUARANTINE_S = 10.0
WAIT_POLL_S = 0.5
#: How long a request waits for a busy replica's room by default, and the pauses between its asks.
BUSY_WAIT_S = 600.0
BUSY_PAUSE_S = (0.05, 2.0)


@dataclass(frozen=True)
class FleetReplica:
    """One replica as weight sync reports it."""

    replica_id: str
    address: str
    active_version: int


@dataclass(frozen=True)
class Fleet:
    """The connected replicas that advertise an address, and the job's active version."""

    active_version: int
    replicas: tuple[FleetReplica, ...]


Discover = Callable[[], Awaitable[Fleet | None]]  # None: could not ask now (keep what is known)
Connect = Callable[[str], Awaitable[object]]  # address -> a RolloutService stub (NamedStub)


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


def gone(error: BaseException) -> bool:
    return isinstance(error, ServiceCallError) and error.code in GONE


class RolloutPool:
    """Duck-types the parts of RolloutServiceStub the loop uses (``Generate``) over N replicas."""

    def __init__(self, stubs: Sequence[object] = (), *, discover: Discover | None = None,
                 connect: Connect | None = None, refresh_s: float = REFRESH_S,
                 quarantine_s: float = QUARANTINE_S, busy_wait_s: float = BUSY_WAIT_S) -> None:
        if not stubs and discover is None:
            raise ValueError("a rollout pool needs at least one replica, or a way to discover them")
        if discover is not None and connect is None:
            raise ValueError("a discovering pool needs connect(address)")
        self.members: dict[str, object] = {getattr(s, "address", "") or f"replica-{i}": s for i, s in enumerate(stubs)}
        self.names: dict[str, str] = {a: a for a in self.members}  # address -> replica id, for messages
        self.discover, self.connect = discover, connect
        self.refresh_s, self.quarantine_s, self.busy_wait_s = refresh_s, quarantine_s, busy_wait_s
        self.busy_waits = 0  # asks repeated because a replica was busy, since take_usage()
        self.set_aside: dict[str, float] = {}  # address -> when its call failed
        self.usage: Counter[str] = Counter()  # prompts served per address since take_usage()
        self.redone = 0  # prompts redone on another replica since take_usage()
        self.served: set[str] = set()  # addresses that have taken prompts
        self.started = bool(stubs)  # past the first wait for a replica: later joins are announced
        self.late: set[str] = set()  # replicas that joined mid-run
        self._refreshed = float("-inf")
        self._lock = asyncio.Lock()

    @property
    def stubs(self) -> list[object]:
        return list(self.members.values())

    # ------------------------------------------------------------------ membership

    async def refresh(self, force: bool = False) -> None:
        """Re-reads the fleet (at most every refresh_s unless forced): joins and departures."""
        if self.discover is None or (not force and time.monotonic() - self._refreshed < self.refresh_s):
            return
        async with self._lock:
            if not force and time.monotonic() - self._refreshed < self.refresh_s:
                return
            fleet = await self.discover()
            self._refreshed = time.monotonic()
            if fleet is None:
                return
            listed = {r.address: r for r in fleet.replicas}
            for address in [a for a in self.members if a not in listed]:
                logger.warning("rollout replica %s at %s left the fleet", self.names.get(address, address), address)
                del self.members[address]
                self.set_aside.pop(address, None)  # when it comes back, it is a fresh joiner
            for address, replica in listed.items():
                if address in self.members:
                    continue
                # A joiner serves once weight sync has caught it up to the job's active version.
                if replica.active_version < fleet.active_version:
                    continue
                assert self.connect is not None
                self.members[address] = await self.connect(address)
                self.names[address] = replica.replica_id
                if self.started:  # mid-run: worth a line; the fleet a run starts with is printed by the launcher
                    self.late.add(address)
                logger.log(logging.WARNING if self.started else logging.INFO,
                           "rollout replica %s at %s joined the fleet (serving v%d)", replica.replica_id, address,
                           replica.active_version)

    def live(self) -> list[tuple[str, object]]:
        now = time.monotonic()
        for address in [a for a, t in self.set_aside.items() if now - t >= self.quarantine_s]:
            del self.set_aside[address]
        return [(a, s) for a, s in self.members.items() if a not in self.set_aside]

    def each_replica(self) -> list[tuple[str, object]]:
        """The live replicas, each called on its own (the policy guard probes every one), waiting for room as
        the pool's own calls do."""
        return [(address, _WaitsForRoom(self, stub)) for address, stub in self.live()]

    async def wait_members(self, timeout_s: float) -> None:
        """Returns once at least one replica can take prompts; RuntimeError naming the wait after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.refresh(force=True)
            if self.live():
                self.started = True
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no rollout replica serves the job after {timeout_s:.0f} s: none is subscribed "
                                   "to weight sync with an address (rollout.weightsync_address), or none caught "
                                   "up to the job's active version")
            await asyncio.sleep(WAIT_POLL_S)

    def take_busy_waits(self) -> int:
        """Asks repeated because a replica was busy, since the last call."""
        waits, self.busy_waits = self.busy_waits, 0
        return waits

    def take_usage(self) -> tuple[dict[str, int], int]:
        """(prompts served per replica id, prompts redone elsewhere) since the last call."""
        usage = {self.names.get(a, a): n for a, n in self.usage.items()}
        redone, self.usage, self.redone = self.redone, Counter(), 0
        return usage, redone

    # ------------------------------------------------------------------ generation

    async def Generate(self, request: rollout_pb2.GenerateRequest, **kwargs) -> rollout_pb2.GenerateResponse:  # noqa: N802
        try:
            await self.refresh()
        except ServiceCallError as e:  # weight sync restarting: the known fleet serves meanwhile
            logger.info("could not re-read the rollout fleet: %s", e)
        results: list[rollout_pb2.PromptCompletions | None] = [None] * len(request.prompts)
        todo, attempt, template, teacher_seconds = list(range(len(request.prompts))), 0, None, 0.0
        while todo:
            members = self.live()
            if not members:  # the loop's recovery waits for a replica (wait_members)
                raise ServiceCallError("rollout", "", "Generate", grpc.StatusCode.UNAVAILABLE,
                                       f"every rollout replica failed in the last {self.quarantine_s:g} s")
            slices = split_evenly(len(todo), len(members))
            tags = [f"r{i}" if not attempt else f"a{attempt}r{i}" for i in range(len(slices))]
            for address, _ in members[:len(slices)]:
                if address not in self.served:
                    self.served.add(address)
                    logger.log(logging.WARNING if address in self.late else logging.INFO,
                               "rollout replica %s is sent its first prompts", self.names.get(address, address))
            outcomes = await asyncio.gather(*(self._one(members[i][1], request, todo[start:end], tags[i], **kwargs)
                                              for i, (start, end) in enumerate(slices)), return_exceptions=True)
            failed: list[tuple[str, BaseException, list[int]]] = []
            for (address, _), (start, end), outcome in zip(members, slices, outcomes, strict=False):
                indices = todo[start:end]
                if isinstance(outcome, BaseException):
                    if not gone(outcome):
                        raise outcome
                    self.set_aside[address] = time.monotonic()
                    failed.append((address, outcome, indices))
                    continue
                template = template or outcome
                teacher_seconds = max(teacher_seconds, outcome.teacher_seconds)  # the replicas score side by side
                self.usage[address] += len(indices)
                for index, result in zip(indices, outcome.results, strict=True):
                    results[index] = result
            if failed and not self.live():
                raise failed[0][1]  # none left to redo them on: the loop's recovery takes over
            for address, error, indices in failed:
                logger.warning("rollout replica %s failed (%s); its %d prompts are redone on the %d other "
                               "replica(s)", self.names.get(address, address), error, len(indices), len(self.live()))
                self.redone += len(indices)
            todo, attempt = sorted(i for _, _, indices in failed for i in indices), attempt + 1
        merged = rollout_pb2.GenerateResponse()
        if template is not None:
            merged.CopyFrom(template)
            del merged.results[:]
        merged.results.extend(r for r in results if r is not None)
        merged.teacher_seconds = teacher_seconds
        return merged

    async def _one(self, stub, request: rollout_pb2.GenerateRequest, indices: list[int], tag: str,
                   **kwargs) -> rollout_pb2.GenerateResponse:
        part = request
        if not (len(indices) == len(request.prompts) and tag == "r0"):
            part = rollout_pb2.GenerateRequest()
            part.CopyFrom(request)
            del part.prompts[:]
            part.prompts.extend(request.prompts[i] for i in indices)
            if request.request_id:
                part.request_id = f"{request.request_id}-{tag}"
        return await self._when_room(stub, part, **kwargs)

    async def _when_room(self, stub, request: rollout_pb2.GenerateRequest, **kwargs) -> rollout_pb2.GenerateResponse:
        """``stub.Generate(request)``, asked again while the replica is busy (for at most busy_wait_s)."""
        deadline, pause = time.monotonic() + self.busy_wait_s, BUSY_PAUSE_S[0]
        while True:
            try:
                return await stub.Generate(request, **kwargs)
            except ServiceCallError as error:
                if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() + pause > deadline:
                    raise
                if pause == BUSY_PAUSE_S[0]:
                    logger.info("rollout replica %s is busy (%s); request %s waits for room (at most %.0f s)",
                                getattr(stub, "address", "") or "?", error.details, request.request_id or "-",
                                self.busy_wait_s)
                self.busy_waits += 1
            await asyncio.sleep(pause)
            pause = min(pause * 2, BUSY_PAUSE_S[1])


class _WaitsForRoom:
    """One replica's stub whose ``Generate`` waits while the replica is busy (``RolloutPool._when_room``)."""

    def __init__(self, pool: RolloutPool, stub: object) -> None:
        self.pool, self.stub = pool, stub

    async def Generate(self, request: rollout_pb2.GenerateRequest, **kwargs) -> rollout_pb2.GenerateResponse:  # noqa: N802
        return await self.pool._when_room(self.stub, request, **kwargs)
