"""Futures as the Tinker client polls them, and each model's requests run in its ``seq_id`` order.

A submit answers at once with a request id; the work runs in the background and its outcome (a JSON
result, protobuf bytes, or an error with a category) waits here until `retrieve_future` asks. A poll is held
up to ``hold_s`` (the client re-polls at once on "try_again", and times out at 45 s). Hand-written: the state
is a few dicts on one event loop, and what it must do (order by seq_id, buffer gaps) is the Tinker contract's.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
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

    def record(self) -> dict[str, Any]:
        """As plain JSON (the request journal, lorarl.tinker.state): protobuf bytes as base64."""
        if self.proto is not None:
            return {"proto": base64.b64encode(self.proto).decode()}
        if self.json is not None:
            return {"json": self.json}
        return {"error": self.error, "category": self.category}

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> Outcome:
        if "proto" in record:
            return cls(proto=base64.b64decode(record["proto"]))
        if "json" in record:
            return cls(json=record["json"])
        return cls(error=str(record.get("error", "")), category=str(record.get("category", "user")))


@dataclass
class Future:
    owner: str = ""  # the tenant whose request it is: only its keys may retrieve it (lorarl.tinker.tenants)
    request_id: str = ""
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
    """Request ids -> outcomes, and per-model queues that run requests in seq_id order. With a ``journal``
    (lorarl.tinker.state.Journal) each request is written as accepted and as settled, and ``restore`` reads them
    back after a restart."""

    def __init__(self, hold_s: float = HOLD_S, journal: Any = None) -> None:
        self.hold_s = hold_s
        self.journal = journal
        self._futures: dict[str, Future] = {}
        self._next_seq: dict[str, int] = {}
        self._waiting: dict[str, dict[int, tuple[Future, Work]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._draining: set[str] = set()  # models whose queue a task is running now
        self._by_seq: dict[tuple[str, int], str] = {}  # (model, seq_id) -> the request accepted as it

    def _new(self, owner: str, model_id: str = "", seq_id: int | None = None) -> tuple[str, Future]:
        self._forget_old()
        request_id = f"req-{uuid.uuid4().hex[:16]}"  # unique across restarts too (the journal keeps old ones)
        future = self._futures[request_id] = Future(owner)
        future.request_id = request_id
        if seq_id is not None:
            self._by_seq[(model_id, seq_id)] = request_id
        if self.journal is not None:
            self.journal.accepted(request_id, owner, model_id, seq_id)
        return request_id, future

    def _settled(self, future: Future, outcome: Outcome) -> None:
        future.outcome = outcome
        future.done.set()
        if self.journal is not None and future.request_id:
            self.journal.settled(future.request_id, outcome.record())

    def restore(self) -> None:
        """The journal's requests after a restart: each finished one retrievable again, one the restart caught
        running failed with a message that says so, and each model's next seq_id after the last it accepted."""
        if self.journal is None:
            return
        for request_id, entry in self.journal.replay().items():
            future = self._futures[request_id] = Future(entry.owner)
            future.request_id = request_id
            future.outcome = Outcome.of_record(entry.outcome or {})
            future.done.set()
            if entry.model and entry.seq is not None:
                self._by_seq[(entry.model, entry.seq)] = request_id
                self._next_seq[entry.model] = max(self._next_seq.get(entry.model, 1), entry.seq + 1)
                self._waiting.setdefault(entry.model, {})

    def _forget_old(self) -> None:
        now = time.monotonic()
        gone = {r for r, f in self._futures.items() if f.read_at and now - f.read_at > KEEP_S}
        for rid in gone:
            del self._futures[rid]
        if gone:
            self._by_seq = {key: rid for key, rid in self._by_seq.items() if rid not in gone}

    def _start(self, future: Future, work: Work) -> asyncio.Task:
        async def run() -> None:
            self._settled(future, await settle(work))

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def submit(self, work: Work, owner: str = "") -> str:
        """Runs ``work`` now (no order to keep: sampling, create_model); its request id, ``owner``'s to retrieve."""
        request_id, future = self._new(owner)
        self._start(future, work)
        return request_id

    def resolved(self, outcome: Outcome, owner: str = "") -> str:
        """A future already settled (a request refused before any work)."""
        request_id, future = self._new(owner)
        self._settled(future, outcome)
        return request_id

    def start_model(self, model_id: str, first_seq: int = 1) -> None:
        self._next_seq.setdefault(model_id, first_seq)
        self._waiting.setdefault(model_id, {})

    def resubmitted(self, model_id: str, seq_id: int, owner: str = "") -> str | None:
        """The request id ``seq_id`` of ``model_id`` was accepted as, when it was (by ``owner``): the SDK sends a
        request again with its seq_id when the answer was lost (a dropped connection, a front restarted after
        it accepted), and gets the first one's future rather than a refusal or a second run."""
        request_id = self._by_seq.get((model_id, seq_id))
        future = self._futures.get(request_id or "")
        return request_id if future is not None and future.owner == owner else None

    def submit_ordered(self, model_id: str, seq_id: int, work: Work, owner: str = "") -> str:
        """Queues ``work`` as request ``seq_id`` of ``model_id``: it runs once every earlier seq_id has run
        (a failed one included), so chunks submitted out of order still train in order."""
        if model_id not in self._next_seq:
            raise UserError(f"unknown model_id {model_id!r}: create it with create_model first")
        expected = self._next_seq[model_id]
        if seq_id < expected or seq_id in self._waiting[model_id] or (
                seq_id == expected and model_id in self._draining):
            raise UserError(f"seq_id {seq_id} of model {model_id!r} was already used (next is {expected})")
        request_id, future = self._new(owner, model_id, seq_id)
        self._waiting[model_id][seq_id] = (future, work)
        if seq_id == expected and model_id not in self._draining:
            self._draining.add(model_id)
            self._start(Future(), lambda: self._drain(model_id))
        return request_id

    def end_model(self, model_id: str, reason: str) -> list[str]:
        """``model_id`` has ended (its session finished or expired): each request of it still waiting for an
        earlier seq_id that will now never come fails with ``reason`` rather than waiting for ever, and the one
        running (if any) is the last. The owners of the requests failed, one per request (their places in their
        tenants' queues are freed by the caller)."""
        waiting = self._waiting.get(model_id, {})
        running = self._next_seq.get(model_id) if model_id in self._draining else None
        owners = []
        for seq_id in sorted(s for s in waiting if s != running):
            future, _ = waiting.pop(seq_id)
            self._settled(future, Outcome(error=reason, category="user"))
            owners.append(future.owner)
        return owners

    async def _drain(self, model_id: str) -> dict[str, Any]:
        waiting = self._waiting[model_id]
        try:
            while self._next_seq[model_id] in waiting:
                future, work = waiting[self._next_seq[model_id]]
                self._settled(future, await settle(work))
                del waiting[self._next_seq[model_id]]
                self._next_seq[model_id] += 1
        finally:
            self._draining.discard(model_id)
        return {}

    async def retrieve(self, request_id: str, owner: str = "") -> Outcome | None:
        """The outcome, waiting up to ``hold_s``; None: not yet (answer "try_again"). KeyError: an unknown id, or
        another tenant's (answered alike: a caller cannot tell another's request from none)."""
        future = self._futures[request_id]
        if future.owner != owner:
            raise KeyError(request_id)
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
        if self.journal is not None:
            self.journal.close()
