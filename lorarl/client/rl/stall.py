"""The stall watchdog: a run that stops moving says what it is stuck on.

Every call the loop makes to a service goes through a NamedStub that records it here while it is in flight;
a call that ends (answered or failed) is progress. When nothing has ended for ``loop.stall.after_s``, the
watchdog names the calls still in flight, oldest first, with their service, address and age — the trainer's
PublishWeights waiting 95 s on a rendezvous reads differently from a rollout's Generate — or says that none
is (the loop is on its own work: episodes, rewards). With ``action: warn`` it logs that once per stall; with
``action: fail`` it ends the run with it (StallError), where each call's own deadline
(``loop.call_timeout_s``) would otherwise be the first thing to end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lorarl.client.job.config import StallSection

logger = logging.getLogger(__name__)
#: How often the watchdog looks, at most (a quarter of after_s when that is shorter).
CHECK_EVERY_S = 5.0


class StallError(RuntimeError):
    """The run ended because nothing moved for loop.stall.after_s (``action: fail``)."""


@dataclass(frozen=True)
class Call:
    service: str
    address: str
    method: str
    started: float


class CallTracker:
    """The calls in flight and when one last ended."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last_progress = clock()
        self._calls: dict[int, Call] = {}
        self._ids = itertools.count()

    @contextlib.contextmanager
    def call(self, service: str, address: str, method: str) -> Iterator[None]:
        key = next(self._ids)
        self._calls[key] = Call(service, address, method, self.clock())
        try:
            yield
        finally:
            del self._calls[key]
            self.progress()

    def progress(self) -> None:
        self.last_progress = self.clock()

    def in_flight(self) -> list[Call]:
        return sorted(self._calls.values(), key=lambda c: c.started)

    def describe(self) -> str:
        """What the run waits on now, in a sentence."""
        now, calls = self.clock(), self.in_flight()
        idle = now - self.last_progress
        if not calls:
            return (f"no progress for {idle:.0f} s and no call to a service in flight: the loop is on its own "
                    "work (episodes, rewards, an agent's HTTP calls)")
        listed = "; ".join(f"{c.service} at {c.address or '?'}: {c.method}, in flight {now - c.started:.0f} s"
                           for c in calls[:4])
        more = f" (+{len(calls) - 4} more)" if len(calls) > 4 else ""
        return f"no progress for {idle:.0f} s; waiting on {listed}{more}"


async def watch(tracker: CallTracker, settings: StallSection) -> None:
    """Runs beside the loop until cancelled: warns once per stall, or raises StallError (``action: fail``)."""
    if not settings.after_s:
        await asyncio.Event().wait()  # off: wait to be cancelled
    warned = None
    while True:
        await asyncio.sleep(min(CHECK_EVERY_S, settings.after_s / 4))
        if tracker.clock() - tracker.last_progress < settings.after_s or warned == tracker.last_progress:
            continue
        message = f"{tracker.describe()} (loop.stall.after_s = {settings.after_s:g})"
        if settings.action == "fail":
            raise StallError(message)
        logger.warning("%s", message)
        warned = tracker.last_progress


async def run_watched(work: asyncio.Future | asyncio.Task, tracker: CallTracker, settings: StallSection) -> None:
    """Awaits ``work`` with the watchdog beside it; a StallError cancels the work and is raised."""
    watchdog = asyncio.ensure_future(watch(tracker, settings))
    work = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({work, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        if watchdog in done:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            watchdog.result()
        await work
    finally:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
