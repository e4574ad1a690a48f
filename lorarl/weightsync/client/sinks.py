"""The rollout side's contract with the agent (PolicySink), and an in-memory sink for tests and benchmarks.

The agent does the transport and the integrity checks; a sink only ever sees complete, verified
tensors. Two-phase: `stage` prepares a version without serving it (raise to reject it: the replica
keeps serving its previous version and the round aborts everywhere), `commit` switches to it,
`abort` drops it. The agent calls the sink from a worker thread, one call at a time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from lorarl.v1 import common_pb2

ADAPTER = common_pb2.SYNC_MODE_ADAPTER
MERGED = common_pb2.SYNC_MODE_MERGED


@dataclass(frozen=True)
class PolicyUpdate:
    """A verified payload of one version and how to serve it.

    serve_mode ADAPTER: load `tensors` as a LoRA adapter (PEFT names, spec in manifest.lora).
    serve_mode MERGED and manifest.mode MERGED: `tensors` are HF-named weights to overwrite.
    serve_mode MERGED and manifest.mode ADAPTER (`local_merge`): merge the adapter into the pristine
    base weights (lorarl.weightsync.wire.merge.merged_from_adapter) and load those.
    Tensors may be views into receive buffers: copy what must outlive the call. Where the sink's
    engine received the version in its own worker (an optional `receive_in_engine(manifest, rendezvous,
    key, serve_mode)` on the sink), `tensors` are meta tensors naming what the worker holds.
    """

    manifest: common_pb2.WeightManifest
    tensors: dict[str, torch.Tensor]
    serve_mode: int

    @property
    def job_id(self) -> str:
        return self.manifest.job_id

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def local_merge(self) -> bool:
        return self.serve_mode == MERGED and self.manifest.mode == ADAPTER


@runtime_checkable
class PolicySink(Protocol):
    """What a rollout engine implements to receive policy versions (see module docstring)."""

    def active_versions(self) -> dict[str, int]:
        """Per job, the version being served now (0 or absent: none); sent on every (re)subscribe."""
        ...

    def stage(self, update: PolicyUpdate) -> None:
        """Prepares a version without serving it; replaces any staged one of the same job; raise to reject."""
        ...

    def commit(self, job_id: str, version: int) -> None:
        """Serves the staged `version` from now on (after in-flight requests of the old one, as the engine likes)."""
        ...

    def abort(self, job_id: str, version: int) -> None:
        """Drops the staged `version` (another replica failed); keep serving the current one."""
        ...


@dataclass
class InMemorySink:
    """Keeps copies of staged and active payloads in dicts; records every call (tests, benchmarks)."""

    staged: dict[str, PolicyUpdate] = field(default_factory=dict)
    active: dict[str, PolicyUpdate] = field(default_factory=dict)
    events: list[tuple[str, str, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def active_versions(self) -> dict[str, int]:
        with self._lock:
            return {job: u.version for job, u in self.active.items()}

    def stage(self, update: PolicyUpdate) -> None:
        copied = PolicyUpdate(update.manifest, {n: t.clone() for n, t in update.tensors.items()}, update.serve_mode)
        with self._lock:
            self.staged[update.job_id] = copied
            self.events.append(("stage", update.job_id, update.version))

    def commit(self, job_id: str, version: int) -> None:
        with self._lock:
            update = self.staged.get(job_id)
            if update is None or update.version != version:
                raise KeyError(f"{job_id} v{version} is not staged")
            self.active[job_id] = self.staged.pop(job_id)
            self.events.append(("commit", job_id, version))

    def abort(self, job_id: str, version: int) -> None:
        with self._lock:
            if job_id in self.staged and self.staged[job_id].version == version:
                del self.staged[job_id]
            self.events.append(("abort", job_id, version))
