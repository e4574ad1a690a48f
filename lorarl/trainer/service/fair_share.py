"""Turns at a shared base, by weighted fair share.

Jobs on one resident base take turns on it (their passes cannot overlap: they share its modules). Without a
rule, whichever engine thread wins the lock goes next, and a job that sends many small calls crowds out one
that sends few large ones. Here each job's turns are charged to it as seconds of compute divided by its
weight (``TrainingSpec.share``), and when the base frees, the waiting job with the least charged time goes
next (start-time fair queueing over measured seconds). A job that was idle does not bank credit: it re-enters
at the time of the turn last granted, so it cannot then hold the base for as long as it was away.

A job created with a tenant's key (trainer.tenants) is charged to its tenant's account instead: a team that
runs many jobs (or floods the Tinker front with models) gets one tenant's share, not one per job.

Plain asyncio: the turn is taken in the service's event loop, before the call goes to an engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    order: int
    account: str
    granted: asyncio.Future[None] = field(repr=False)


class FairShare:
    """One shared resource's turns; ``turn(job_id, weight)`` holds it for the body of an ``async with``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.charged: dict[str, float] = {}  # account -> seconds of its turns / weight (its virtual time)
        self.waited: dict[str, float] = {}  # job -> seconds its calls waited for a turn
        self.turns: dict[str, int] = {}
        self._now = 0.0  # the charged time of the turn granted last: where a returning job re-enters
        self._busy = False
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()

    def forget(self, job_id: str) -> None:
        """A deleted job's accounts."""
        for book in (self.charged, self.waited, self.turns):
            book.pop(job_id, None)

    @contextlib.asynccontextmanager
    async def turn(self, job_id: str, weight: float = 1.0, account: str | None = None) -> AsyncIterator[None]:
        """The base for the body; charged to ``account`` (a tenant's; None: the job's own), its wait and turn
        counted to the job."""
        if weight <= 0:
            raise ValueError(f"a job's share must be > 0, got {weight}")
        account = account or job_id
        self.charged[account] = max(self.charged.get(account, self._now), self._now)
        asked = self._clock()
        await self._acquire(account)
        started = self._clock()
        self.waited[job_id] = self.waited.get(job_id, 0.0) + started - asked
        self.turns[job_id] = self.turns.get(job_id, 0) + 1
        try:
            yield
        finally:
            self.charged[account] = self.charged.get(account, self._now) + (self._clock() - started) / weight
            self._release()

    async def _acquire(self, account: str) -> None:
        if not self._busy and not self._waiting:
            self._busy, self._now = True, self.charged[account]
            return
        waiter = _Waiter(next(self._order), account, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release()  # granted as it was cancelled: pass the turn on
            else:
                self._waiting.remove(waiter)
            raise

    def _release(self) -> None:
        self._busy = False
        if not self._waiting:
            return
        chosen = min(self._waiting, key=lambda w: (self.charged.get(w.account, self._now), w.order))
        self._waiting.remove(chosen)
        self._busy, self._now = True, self.charged.get(chosen.account, self._now)
        chosen.granted.set_result(None)
