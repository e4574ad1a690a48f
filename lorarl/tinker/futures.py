"""Futures as the Tinker client polls them, and each model's requests run in its ``seq_id`` order.

A submit answers at once with a request id; the work runs in the background and its outcome (a JSON
result, protobuf bytes, or an error with a category) waits here until `retrieve_future` asks. A poll is held
up to ``hold_s`` (the client re-polls at once on "try_again", and times out at 45 s). Hand-written: the state
is a few dicts on one event loop, and what it must do (order by seq_id, buffer gaps) is the Tinker contract's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds a retrieve_future poll is held open before "try_again" (the SDK's own timeout is 45 s).
HOLD_S = 25.0
#: Finished outcomes kept this long after they were first read, then forgotten (a retry may re-read one).
KEEP_S = 600.0


class UserError(Exception):
    """A request the caller can fix: its future fails with category "user" and this message."""


@dataclass
class Outcome:
    """What a future resolved to: exactly one of ``json``, ``proto`` or ``error``."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str = ""
    category: str = "user"


@dataclass
class Future:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    read_at: float = 0.0


Work = Callable[[], Awaitable[Outcome | dict[str, Any] | bytes]]


async def settle(work: Work) -> Outcome:
    """Runs ``work``; its value, or a UserError / any other exception, as an Outcome (never raises)."""
    try:
        value = await work()
    except UserError as e:
        return Outcome(error=str(e), category="user")
    except Exception as e:  # a server fault: the future says so instead of the poll failing (5xx is retried)
        logger.exception("tinker request failed")
        return Outcome(error=f"{type(e).__name__}: {e}", category="server")
    if isinstance(value, Outcome):
        return value
    return Outcome(proto=value) if isinstance(value, bytes) else Outcome(json=value)


class Futures:
    """Request ids -> outcomes, and per-model queues that run requests in seq_id order."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._ids = itertools.count(1)
        self._futures: dict[str, Future] = {}
        self._next_seq: dict[str, int] = {}
        self._waiting: dict[str, dict[int, tuple[Future, Work]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._draining: set[str] = set()  # models whose queue a task is running now

    def _new(self) -> tuple[str, Future]:
        self._forget_old()
        request_id = f"req-{next(self._ids)}"
        future = self._futures[request_id] = Future()
        return request_id, future

    def _forget_old(self) -> None:
        now = time.monotonic()
        for rid in [r for r, f in self._futures.items() if f.read_at and now - f.read_at > KEEP_S]:
            del self._futures[rid]

    def _start(self, future: Future, work: Work) -> asyncio.Task:
        async def run() -> None:
            future.outcome = await settle(work)
            future.done.set()

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def submit(self, work: Work) -> str:
        """Runs ``work`` now (no order to keep: sampling, create_model); its request id."""
        request_id, future = self._new()
        self._start(future, work)
        return request_id

    def resolved(self, outcome: Outcome) -> str:
        """A future already settled (a request refused before any work)."""
        request_id, future = self._new()
        future.outcome = outcome
        future.done.set()
        return request_id

    def start_model(self, model_id: str, first_seq: int = 1) -> None:
        self._next_seq.setdefault(model_id, first_seq)
        self._waiting.setdefault(model_id, {})

    def submit_ordered(self, model_id: str, seq_id: int, work: Work) -> str:
        """Queues ``work`` as request ``seq_id`` of ``model_id``: it runs once every earlier seq_id has run
        (a failed one included), so chunks submitted out of order still train in order."""
        if model_id not in self._next_seq:
            raise UserError(f"unknown model_id {model_id!r}: create it with create_model first")
        expected = self._next_seq[model_id]
        if seq_id < expected or seq_id in self._waiting[model_id] or (
                seq_id == expected and model_id in self._draining):
            raise UserError(f"seq_id {seq_id} of model {model_id!r} was already used (next is {expected})")
        request_id, future = self._new()
        self._waiting[model_id][seq_id] = (future, work)
        if seq_id == expected and model_id not in self._draining:
            self._draining.add(model_id)
            self._start(Future(), lambda: self._drain(model_id))
        return request_id

    async def _drain(self, model_id: str) -> dict[str, Any]:
        waiting = self._waiting[model_id]
        try:
            while self._next_seq[model_id] in waiting:
                future, work = waiting[self._next_seq[model_id]]
                future.outcome = await settle(work)
                future.done.set()
                del waiting[self._next_seq[model_id]]
                self._next_seq[model_id] += 1
        finally:
            self._draining.discard(model_id)
        return {}

    async def retrieve(self, request_id: str) -> Outcome | None:
        """The outcome, waiting up to ``hold_s``; None: not yet (answer "try_again"). KeyError: unknown id."""
        future = self._futures[request_id]
        if not future.done.is_set():
            try:
                await asyncio.wait_for(asyncio.shield(future.done.wait()), self.hold_s)
            except TimeoutError:
                return None
        future.read_at = future.read_at or time.monotonic()
        return future.outcome

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
