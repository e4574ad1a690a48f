"""The rollout replicas the service knows: capabilities, connection, per-job versions, event outbox.

A replica is known by its id across reconnects: a new Subscribe replaces the previous stream (the
old one is closed with a None sentinel), and state survives the gap, so status can say who was
serving what when it dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lorarl.v1 import weightsync_pb2

logger = logging.getLogger(__name__)


class Outbox(Protocol):
    def put_nowait(self, item: Any) -> None: ...


@dataclass
class JobReplicaState:
    """One replica's versions for one job, as it reported them."""

    active_version: int = 0
    staged_version: int = 0
    last_error: str = ""


@dataclass
class Replica:
    replica_id: str
    capabilities: weightsync_pb2.ReplicaCapabilities
    host: str
    job_ids: frozenset[str]
    connected: bool = False
    session: int = 0
    outbox: Outbox | None = None
    jobs: dict[str, JobReplicaState] = field(default_factory=dict)
    serve_address: str = ""  # where clients reach its RolloutService ("": not advertised)

    def wants(self, job_id: str) -> bool:
        """Subscribed to `job_id` (an empty job list means every job)."""
        return not self.job_ids or job_id in self.job_ids

    def state(self, job_id: str) -> JobReplicaState:
        return self.jobs.setdefault(job_id, JobReplicaState())


class ReplicaDirectory:
    """Every replica seen since start; sends events to the connected ones."""

    def __init__(self, outbox_factory: Callable[[], Outbox] = asyncio.Queue) -> None:
        self.replicas: dict[str, Replica] = {}
        self._outbox_factory = outbox_factory
        self._sessions = 0

    def connect(self, request: weightsync_pb2.SubscribeRequest) -> Replica:
        """Registers a (re)subscribing replica with a fresh outbox; its reported active versions win."""
        self._sessions += 1
        replica = self.replicas.get(request.replica_id)
        if replica is None:
            replica = Replica(request.replica_id, request.capabilities, request.host, frozenset(request.job_ids))
            self.replicas[request.replica_id] = replica
        elif replica.connected and replica.outbox is not None:
            replica.outbox.put_nowait(None)  # ends the stream this one replaces
        replica.capabilities.CopyFrom(request.capabilities)
        replica.host, replica.job_ids = request.host, frozenset(request.job_ids)
        replica.serve_address = request.serve_address
        replica.connected, replica.session, replica.outbox = True, self._sessions, self._outbox_factory()
        for job_id, state in replica.jobs.items():
            state.active_version = request.active_versions.get(job_id, 0)
            state.staged_version = 0
        for job_id, version in request.active_versions.items():
            replica.state(job_id).active_version = version
        return replica

    def disconnect(self, replica_id: str, session: int) -> bool:
        """Marks the replica gone if `session` is still its current stream; True if it was."""
        replica = self.replicas.get(replica_id)
        if replica is None or replica.session != session or not replica.connected:
            return False
        replica.connected, replica.outbox = False, None
        return True

    def send(self, replica_id: str, event: weightsync_pb2.SubscribeResponse) -> bool:
        replica = self.replicas.get(replica_id)
        if replica is None or not replica.connected or replica.outbox is None:
            return False
        replica.outbox.put_nowait(event)
        return True

    def connected(self, replica_id: str) -> bool:
        replica = self.replicas.get(replica_id)
        return replica is not None and replica.connected

    def subscribers(self, job_id: str, connected_only: bool = True) -> list[Replica]:
        return [r for _, r in sorted(self.replicas.items())
                if r.wants(job_id) and (r.connected or not connected_only)]

    def state(self, replica_id: str, job_id: str) -> JobReplicaState:
        return self.replicas[replica_id].state(job_id)
