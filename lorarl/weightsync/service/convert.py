"""Protobuf <-> plain Python for the weight-sync servicer: the requests' fields in, the results out."""

from __future__ import annotations

from collections.abc import Sequence

from lorarl.v1 import weightsync_pb2
from lorarl.weightsync.service.results import (
    ActivationResult,
    JobSyncStatus,
    Published,
    RegisteredJob,
    ReplicaSyncStatus,
)


def registered(job: RegisteredJob) -> weightsync_pb2.RegisterJobResponse:
    return weightsync_pb2.RegisterJobResponse(mode=job.mode, reason=job.reason, latest_version=job.latest_version)


def published(result: Published) -> weightsync_pb2.PublishManifestResponse:
    return weightsync_pb2.PublishManifestResponse(manifest=result.manifest, sender_rank=result.sender_rank,
                                                  duplicate=result.duplicate)


def activation(result: ActivationResult) -> weightsync_pb2.AwaitActivationResponse:
    return weightsync_pb2.AwaitActivationResponse(
        job_id=result.job_id, version=result.version, outcome=result.outcome, error=result.error,
        failed_replicas=result.failed_replicas,
        replicas=[weightsync_pb2.ReplicaActivation(replica_id=r.replica_id, staged=r.staged, active=r.active,
                                                   error=r.error, transport=r.transport) for r in result.replicas])


def sync_status(jobs: list[JobSyncStatus], fleet: Sequence[ReplicaSyncStatus] = ()
                ) -> weightsync_pb2.GetSyncStatusResponse:
    response = weightsync_pb2.GetSyncStatusResponse()
    for r in fleet:
        response.fleet.add(replica_id=r.replica_id, connected=r.connected, serve_address=r.serve_address,
                           capabilities=r.capabilities)
    for job in jobs:
        entry = response.jobs.add(job_id=job.job_id, latest_version=job.latest_version, mode=job.mode,
                                  active_version=job.active_version, mode_reason=job.mode_reason)
        for r in job.replicas:
            entry.replicas.add(replica_id=r.replica_id, active_version=r.active_version,
                               staged_version=r.staged_version, connected=r.connected, last_error=r.last_error,
                               serve_address=r.serve_address)
    return response
