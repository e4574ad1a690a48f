"""Who is calling the Tinker front, what they may touch, and how much of the shared services they may hold.

A tenant is a team: its API keys, its limits, and, on a trainer that has tenants of its own
(`trainer.tenants`, lorarl.trainer.service.tenancy), the trainer key its calls present — so the trainer itself
confines the tenant to its jobs, charges its turns at the base to the tenant as one account (fair share,
lorarl.trainer.service.fair_share) and applies its per-job token quota. The front does not keep a second
copy of those rules; it adds what only it sees:

- ownership: each session, model, sampler, ``tinker://`` path, training run and future belongs to the tenant
  whose key made it; another tenant's is answered as unknown (it cannot see, sample, train, load or delete it);
- ``max_models``: training models (trainer jobs) alive at once;
- ``max_sampling_models``: models (and restored sampler paths) whose weights the shared rollout holds for it —
  its adapter slots there;
- ``max_in_flight`` and ``max_waiting``: its requests running at the services at once, and queued behind them.
  A flood waits behind its own requests only; past the queue the front answers HTTP 429 with Retry-After. The
  SDK reads 429 as backpressure (docs/tinker_protocol.md section 2): a sample is resubmitted after a pause, other
  calls retried with backoff for up to 5 minutes, then raised with the body naming the limit — a burst slows
  down instead of failing. Why 429 and not a settled "user" error: the request was well formed and will succeed
  later; why not 503: the service is not down for anyone else.

Plain `tinker.api_keys` / `api_key_file` keys form one tenant, DEFAULT_TENANT (their holders share everything,
as before tenants existed).
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TENANT = "default"
#: A tenant's name goes into its trainer job ids (``tinker-<name>-...``): kept to what a job id may hold.
NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
#: Seconds a 429 asks the SDK to wait before it retries (it honours 0 < Retry-After <= 60).
RETRY_AFTER_S = 2


@dataclass(frozen=True)
class TenantLimits:
    """How much of the shared services one tenant may hold (defaults: a team's working set on a small stack)."""

    max_models: int = 16
    max_sampling_models: int = 16
    max_in_flight: int = 32
    max_waiting: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_models", "max_sampling_models", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")


@dataclass(frozen=True)
class FrontTenant:
    name: str
    keys: tuple[str, ...]
    limits: TenantLimits = field(default_factory=TenantLimits)
    trainer_token: str | None = None  # its key on the trainer (trainer.tenants); None: the front's service token

    @property
    def job_prefix(self) -> str:
        """Its trainer jobs' ids start with this (a trainer tenant's `jobs: ['tinker-team-a-*']` matches)."""
        return "tinker-" if self.name == DEFAULT_TENANT else f"tinker-{self.name}-"


class FrontTenants:
    """The configured tenants; ``of_key`` finds the caller's by its X-API-Key (compared in constant time)."""

    def __init__(self, tenants: list[FrontTenant]) -> None:
        names = [t.name for t in tenants]
        if not tenants or len(set(names)) != len(names):
            raise ValueError(f"tenants need distinct names, got {names}")
        keys = [k for t in tenants for k in t.keys]
        if any(not k.startswith("tml-") for k in keys):
            raise ValueError("the Tinker front needs API keys, each starting with 'tml-' (the SDK refuses others)")
        if len(set(keys)) != len(keys):
            raise ValueError("two tenants share an API key; each key belongs to one tenant")
        for name in names:
            if not NAME.match(name):
                raise ValueError(f"tenant name {name!r}: lower-case letters, digits and '-', at most 32")
        self.by_name = {t.name: t for t in tenants}
        self._keys = [(k.encode(), t) for t in tenants for k in t.keys]

    @classmethod
    def single(cls, keys: list[str]) -> FrontTenants:
        """Every key one tenant (the front before tenants, `lorarl tinker`'s one generated key)."""
        return cls([FrontTenant(DEFAULT_TENANT, tuple(keys))])

    def of_key(self, presented: str) -> FrontTenant | None:
        raw = presented.encode()
        found = None
        for key, tenant in self._keys:  # every key compared: the time does not say which one matched
            if hmac.compare_digest(raw, key):
                found = tenant
        return found

    def __getitem__(self, name: str) -> FrontTenant:
        return self.by_name[name]


class TooManyRequestsError(Exception):
    """A tenant's queue is full: HTTP 429 with Retry-After (the SDK waits, then retries)."""


Work = Callable[[], Awaitable[Any]]


class Admission:
    """Each tenant's requests at the services: at most ``max_in_flight`` run at once, the rest wait in order
    behind them (its own queue: another tenant's requests never wait here), and a request arriving to
    ``max_waiting`` already waiting is refused (TooManyRequestsError) before it is accepted."""

    def __init__(self, tenants: FrontTenants) -> None:
        self.tenants = tenants
        self._slots: dict[str, asyncio.Semaphore] = {}
        self.pending: dict[str, int] = {}  # tenant -> requests accepted and not finished (running or waiting)
        self.running: dict[str, int] = {}  # tenant -> requests at the services now

    def admitted(self, tenant: str, work: Work) -> Work:
        """``work`` counted against ``tenant`` from now: run once one of its slots is free. Refused here, before
        a request id exists, when its queue is full."""
        limits = self.tenants[tenant].limits
        pending = self.pending.get(tenant, 0)
        if pending >= limits.max_in_flight + limits.max_waiting:
            raise TooManyRequestsError(
                f"tenant {tenant!r} has {limits.max_in_flight} requests running and {limits.max_waiting} waiting, "
                f"its limits (tinker.tenants[].max_in_flight, max_waiting): retry once some have finished")
        self.pending[tenant] = pending + 1
        slots = self._slots.setdefault(tenant, asyncio.Semaphore(limits.max_in_flight))

        async def run() -> Any:
            try:
                async with slots:
                    self.running[tenant] = self.running.get(tenant, 0) + 1
                    try:
                        return await work()
                    finally:
                        self.running[tenant] -= 1
            finally:
                self.pending[tenant] -= 1

        return run

    def withdraw(self, tenant: str) -> None:
        """An admitted request that will never run — refused before it was queued (a used seq_id), or failed
        while it waited for its model's earlier seq_ids (the model ended): not pending."""
        self.pending[tenant] -= 1
