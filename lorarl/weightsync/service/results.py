"""What the weight-sync core answers, as plain data; lorarl.weightsync.service.convert writes the protos.

The core's inputs that are documents of the wire format (a job's registration with its catalog, a
manifest, a subscription with its capabilities, chunks) stay protos: the core stores and relays
them verbatim. Everything else goes in as plain arguments and comes back as these."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorarl.v1 import common_pb2, weightsync_pb2


@dataclass(frozen=True)
class RegisteredJob:
    mode: int  # common_pb2.SyncMode the job syncs with
    reason: str
    latest_version: int


@dataclass(frozen=True)
class Published:
    manifest: common_pb2.WeightManifest  # what the trainer sends by: its transport, group and rank
    sender_rank: int = 0
    duplicate: bool = False


@dataclass(frozen=True)
class ReplicaOutcome:
    replica_id: str
    staged: bool
    active: bool
    error: str
    transport: str  # "collective" | "inline" | "shared_memory"


@dataclass(frozen=True)
class ActivationResult:
    job_id: str
    version: int
    outcome: int  # weightsync_pb2.ActivationOutcome
    error: str = ""
    failed_replicas: list[str] = field(default_factory=list)
    replicas: list[ReplicaOutcome] = field(default_factory=list)


@dataclass(frozen=True)
class ReplicaSyncStatus:
    replica_id: str
    active_version: int
    staged_version: int
    connected: bool
    last_error: str
    serve_address: str = ""
    capabilities: weightsync_pb2.ReplicaCapabilities | None = None  # what it subscribed with (the fleet's view)


@dataclass(frozen=True)
class JobSyncStatus:
    job_id: str
    latest_version: int
    active_version: int
    mode: int
    mode_reason: str
    replicas: list[ReplicaSyncStatus]
