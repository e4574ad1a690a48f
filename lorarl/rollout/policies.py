"""Which policy versions a replica holds, which one serves a request, and when an old one may go.

Pure bookkeeping (no engine, no asyncio), so the rules are unit-tested on their own:

- Adapter jobs keep a window of versions loaded; a commit makes the new version the latest and
  retires versions beyond the window. A retiring version serves no new request and is unloaded
  once the requests using it have finished (`release` says when).
- A merged job owns the engine's weights: one version at a time. While one is loaded, the base
  model and adapter jobs cannot be served (their base weights are gone).
- Staged versions are loaded but not servable until committed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lorarl.common.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError
from lorarl.contract import versions
from lorarl.rollout.schema import BASE_JOB, LATEST, AdapterHandle, Mode, PolicyRef, ServedPolicy

BASE_POLICY = ServedPolicy(job_id=BASE_JOB, version=versions.BASE)


class State(enum.Enum):
    STAGED = "staged"
    READY = "ready"
    RETIRING = "retiring"


@dataclass
class LoadedVersion:
    job_id: str
    version: int
    mode: Mode
    state: State = State.STAGED
    adapter: AdapterHandle | None = None
    weights_token: str | None = None
    in_flight: int = 0
    weights: str = ""  # the version's fingerprint (PolicyPayload.weights)

    @property
    def served(self) -> ServedPolicy:
        return ServedPolicy(self.job_id, self.version, self.mode, self.adapter, self.weights)

    def __str__(self) -> str:
        return f"{self.job_id} v{self.version}"


class PolicyTable:
    """Loaded versions per job (see module docstring). `capacity`: adapters the engine can hold."""

    def __init__(self, window: int, capacity: int) -> None:
        if window < 1 or capacity < 1:
            raise ValueError("window and capacity must be >= 1")
        self.window = window
        self.capacity = capacity
        self.jobs: dict[str, dict[int, LoadedVersion]] = {}
        self.merged: LoadedVersion | None = None
        self.base_in_flight = 0
        self._next_lora_id = 1

    # ------------------------------------------------------------------------------ queries

    def get(self, job_id: str, version: int) -> LoadedVersion | None:
        return self.jobs.get(job_id, {}).get(version)

    def all_versions(self) -> list[LoadedVersion]:
        return [v for job in sorted(self.jobs) for _, v in sorted(self.jobs[job].items())]

    def latest(self, job_id: str) -> LoadedVersion | None:
        ready = [v for v in self.jobs.get(job_id, {}).values() if v.state is State.READY]
        return max(ready, key=lambda v: v.version) if ready else None

    def active_versions(self) -> dict[str, int]:
        """Per job, the version "latest" resolves to now."""
        return {job: latest.version for job in self.jobs if (latest := self.latest(job)) is not None}

    def job_mode(self, job_id: str) -> Mode | None:
        versions = self.jobs.get(job_id)
        return next(iter(versions.values())).mode if versions else None

    def adapters_loaded(self) -> int:
        return sum(1 for v in self.all_versions() if v.adapter is not None)

    def in_flight(self) -> int:
        return self.base_in_flight + sum(v.in_flight for v in self.all_versions())

    def resolve(self, ref: PolicyRef) -> ServedPolicy:
        """The policy a request is served by now; NOT_FOUND / FAILED_PRECONDITION say why not."""
        if ref.is_base:
            if ref.version != LATEST:
                raise NotFoundError("the base model has no versions: leave policy.version 0 for it")
            self._require_base_weights("the base model")
            return BASE_POLICY
        versions = self.jobs.get(ref.job_id)
        if not versions:
            loaded = sorted(self.jobs) or "none"
            raise NotFoundError(f"no policy of job {ref.job_id!r} is loaded on this replica (jobs: {loaded})")
        mode = self.job_mode(ref.job_id)
        if mode is Mode.ADAPTER:
            self._require_base_weights(f"adapter job {ref.job_id!r}")
        if ref.version == LATEST:
            latest = self.latest(ref.job_id)
            if latest is None:
                raise NotFoundError(f"job {ref.job_id!r} has no committed version yet")
            return latest.served
        found = versions.get(ref.version)
        if found is None or found.state is not State.READY:
            why = "is not loaded" if found is None else f"is {found.state.value}, not servable"
            ready = sorted(v.version for v in versions.values() if v.state is State.READY)
            raise NotFoundError(f"{ref.job_id} v{ref.version} {why} (servable versions: {ready})")
        return found.served

    def _require_base_weights(self, what: str) -> None:
        if self.merged is not None:
            raise FailedPreconditionError(f"cannot serve {what}: the engine's weights are replaced by merged "
                                          f"{self.merged}; unload that job to serve the base model again")

    # -------------------------------------------------------------------- in-flight counts

    def acquire(self, policy: ServedPolicy) -> None:
        if policy.job_id == BASE_JOB:
            self.base_in_flight += 1
            return
        loaded = self.get(*policy.key)
        if loaded is not None:
            loaded.in_flight += 1

    def release(self, policy: ServedPolicy) -> LoadedVersion | None:
        """Counts a finished request; returns the version if it is now retired and drained (unload it)."""
        if policy.job_id == BASE_JOB:
            self.base_in_flight = max(0, self.base_in_flight - 1)
            return None
        loaded = self.get(*policy.key)
        if loaded is None:
            return None
        loaded.in_flight = max(0, loaded.in_flight - 1)
        return loaded if loaded.state is State.RETIRING and loaded.in_flight == 0 else None

    # ------------------------------------------------------------------------- lifecycle

    def check_stage(self, job_id: str, version: int, mode: Mode) -> None:
        """Refuses versions that are not newer, mode changes, and a second merged job."""
        if not versions.publishable(version):
            raise FailedPreconditionError(f"{job_id} v{version}: versions start at {versions.FIRST}")
        known = self.job_mode(job_id)
        if known is not None and known is not mode:
            raise FailedPreconditionError(f"job {job_id!r} is served as {known.value} on this replica; "
                                          f"unload it before loading {mode.value} versions")
        latest = self.latest(job_id)
        if latest is not None and version <= latest.version:
            raise FailedPreconditionError(f"{job_id} v{version} is not newer than the active v{latest.version}")
        if mode is Mode.MERGED and self.merged is not None and self.merged.job_id != job_id:
            raise FailedPreconditionError(f"the engine's weights belong to merged {self.merged}; "
                                          "unload it before loading another merged job")
        if mode is Mode.ADAPTER:
            self._require_base_weights(f"adapter job {job_id!r}")

    def new_adapter_id(self) -> int:
        lora_int_id = self._next_lora_id
        self._next_lora_id += 1
        return lora_int_id

    def staged(self, job_id: str) -> LoadedVersion | None:
        return next((v for v in self.jobs.get(job_id, {}).values() if v.state is State.STAGED), None)

    def add(self, loaded: LoadedVersion) -> None:
        self.jobs.setdefault(loaded.job_id, {})[loaded.version] = loaded

    def remove(self, loaded: LoadedVersion) -> None:
        versions = self.jobs.get(loaded.job_id, {})
        versions.pop(loaded.version, None)
        if not versions:
            self.jobs.pop(loaded.job_id, None)
        if self.merged is loaded:
            self.merged = None

    def make_room(self, job_id: str) -> list[LoadedVersion]:
        """Adapters to unload so one more of `job_id` fits in the engine: drained retiring versions first, then
        the job's own older, idle versions, then other jobs' older, idle versions (oldest first, from the job
        holding most): every job keeps its latest version and whatever is in flight; older versions are a cache
        that gives way to another job's arrival (a pinned episode that finds its version gone samples the latest,
        and a Tinker front restores a sampler path from its export). RESOURCE_EXHAUSTED when every slot holds
        a latest version or a request."""
        free = self.capacity - self.adapters_loaded()
        if free > 0:
            return []

        def idle_old(job: str) -> list[LoadedVersion]:
            latest = self.latest(job)
            return sorted((v for v in self.jobs.get(job, {}).values()
                           if v.state is State.READY and v is not latest and v.in_flight == 0 and v.adapter),
                          key=lambda v: v.version)

        retiring = [v for v in self.all_versions() if v.state is State.RETIRING and v.in_flight == 0]
        others = sorted((idle_old(job) for job in self.jobs if job != job_id), key=len, reverse=True)
        chosen = [*retiring, *idle_old(job_id), *(v for versions in others for v in versions)][: 1 - free]
        if len(chosen) < 1 - free:
            held = [f"{v}" + (f" ({v.in_flight} in flight)" if v.in_flight else " (its job's latest)"
                              if v is self.latest(v.job_id) else f" ({v.state.value})")
                    for v in self.all_versions() if v.adapter is not None]
            raise ResourceExhaustedError(
                f"no adapter slot free for {job_id}: {self.adapters_loaded()} of {self.capacity} loaded, each a "
                f"job's latest version or in flight: {', '.join(held)}; unload a job (a Tinker session's end does) "
                "or raise rollout.max_loras")
        return chosen

    def commit(self, job_id: str, version: int) -> list[LoadedVersion]:
        """Makes a staged version the latest; returns versions retired and already drained (unload them)."""
        loaded = self.get(job_id, version)
        if loaded is None or loaded.state is not State.STAGED:
            raise NotFoundError(f"{job_id} v{version} is not staged on this replica")
        loaded.state = State.READY
        drained: list[LoadedVersion] = []
        if loaded.mode is Mode.MERGED:
            previous = self.merged
            self.merged = loaded
            for other in list(self.jobs[job_id].values()):
                if other is not loaded and other.state is not State.STAGED:
                    self.jobs[job_id].pop(other.version)
            if previous is not None and previous.job_id != job_id:
                self.remove(previous)
            return drained
        kept = sorted((v for v in self.jobs[job_id].values() if v.state is not State.STAGED),
                      key=lambda v: v.version, reverse=True)
        for old in kept[self.window:]:
            if old.state is State.READY:
                old.state = State.RETIRING
            if old.in_flight == 0:
                drained.append(old)
        return drained

    def retire_job(self, job_id: str, version: int = LATEST) -> tuple[list[LoadedVersion], list[LoadedVersion]]:
        """Marks a job's versions (or one) for unloading; returns (drained now, still in flight)."""
        versions = self.jobs.get(job_id, {})
        chosen = list(versions.values()) if version == LATEST else [v for v in [versions.get(version)] if v]
        if not chosen:
            raise NotFoundError(f"{job_id} {'has no versions' if version == LATEST else f'v{version} is not'} "
                                "loaded on this replica")
        for v in chosen:
            v.state = State.RETIRING
        return [v for v in chosen if v.in_flight == 0], [v for v in chosen if v.in_flight > 0]
