"""Who receives a version and how: the trainer's memory file for a replica co-located with it (one shared base),
collective rendezvous for those who can, inline for the rest.

The trainer's sender is rank 0 and hosts the group's store at the address it reported (so the
master address is one the replicas can reach, across hosts). Each collective member gets ranks from 1
on, one per process it receives with (contract/transfer_ranks.py: a tensor-parallel engine receiving
in its workers holds one per worker); the group name is unique per publish. A replica that cannot
join the configured backend, or a trainer that reported no address, means inline: the replica
fetches the durable adapter from the service (and merges it locally in a MERGED job), so the
service never stores merged weights.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from lorarl.contract.transfer_ranks import ranks_for_version
from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.service.config import WeightSyncSettings
from lorarl.weightsync.service.modes import serve_mode, sharing_blocker
from lorarl.weightsync.service.registry import JobRecord, VersionRecord
from lorarl.weightsync.service.replicas import Replica
from lorarl.weightsync.service.rounds import Member, Round
from lorarl.weightsync.wire.collective import BACKEND_PROTO

SENDER_RANK = 0


@dataclass
class PublishPlan:
    round: Round
    #: The manifest the trainer gets back: collective transport filled, or inline (upload only).
    trainer_manifest: common_pb2.WeightManifest


def replica_blocker(replica: Replica, job: JobRecord) -> str | None:
    """Why ``replica`` is left out of ``job``'s rounds: another base model, or a shared engine the job would write
    over (lorarl.weightsync.service.modes.sharing_blocker); None when it takes part."""
    theirs = replica.capabilities.base_model_fingerprint
    if theirs and theirs != job.spec.fingerprint:
        return f"replica serves base model {theirs}, job {job.job_id} needs {job.spec.fingerprint}"
    return sharing_blocker(replica.capabilities, job.mode, job.spec.lora)


def _with_transport(manifest: common_pb2.WeightManifest, transport: common_pb2.Transport) -> common_pb2.WeightManifest:
    out = common_pb2.WeightManifest()
    out.CopyFrom(manifest)
    out.transport.CopyFrom(transport)
    return out


def inline_transport(settings: WeightSyncSettings) -> common_pb2.Transport:
    return common_pb2.Transport(inline=common_pb2.InlineTransport(chunk_bytes=settings.chunk_bytes))


def co_located(replica: Replica, handle: common_pb2.SharedMemoryTransport | None) -> bool:
    """Whether ``replica`` computes on the shared base the trainer's memory file ``handle`` was made beside: then
    it maps that file (placement.colocate) instead of joining a collective group or fetching inline."""
    return bool(handle and handle.colocation_id and handle.colocation_id == replica.capabilities.colocation_id)


def plan_publish(settings: WeightSyncSettings, job: JobRecord, record: VersionRecord, replicas: list[Replica],
                 sender_host: str, sender_port: int,
                 shared_memory: common_pb2.SharedMemoryTransport | None = None) -> PublishPlan:
    """The round for a new version over `replicas` (already filtered to eligible ones). A replica co-located with
    the trainer (``shared_memory``: the payload in the trainer's memory file) maps it, if it serves the version as
    the trainer sent it; the rest join the collective group when they can, else fetch inline."""
    backend = BACKEND_PROTO[settings.collective_backend]
    can_broadcast = settings.transport == "collective" and bool(sender_host) and sender_port > 0
    modes = {r.replica_id: serve_mode(job.mode, r.capabilities, job.spec.lora) for r in replicas}
    mapped = [r for r in replicas if co_located(r, shared_memory) and modes[r.replica_id] == record.manifest.mode]
    collective = [r for r in replicas if r not in mapped and can_broadcast
                  and backend in r.capabilities.collective_backends]
    inline = [r for r in replicas if r not in collective and r not in mapped]
    counts = {r.replica_id: ranks_for_version(r.capabilities.receiving_ranks, record.manifest.mode,
                                              modes[r.replica_id]) for r in collective}
    ranks, next_rank = {}, SENDER_RANK + 1
    for r in collective:
        ranks[r.replica_id], next_rank = next_rank, next_rank + counts[r.replica_id]
    group = common_pb2.CollectiveTransport(
        backend=backend, master_address=sender_host, master_port=sender_port,
        group_name=f"{job.job_id}/v{record.version}/{uuid.uuid4().hex[:12]}", world_size=next_rank,
        source_rank=SENDER_RANK, replica_ranks=ranks, timeout_seconds=int(settings.collective_timeout_s),
        replica_rank_counts={k: v for k, v in counts.items() if v > 1})
    broadcast_manifest = _with_transport(record.manifest, common_pb2.Transport(collective=group))
    inline_manifest = _with_transport(record.adapter, inline_transport(settings))
    members: dict[str, Member] = {}
    for r in collective:
        stage = weightsync_pb2.StageEvent(manifest=broadcast_manifest, rank=ranks[r.replica_id],
                                          serve_mode=modes[r.replica_id], rank_count=counts[r.replica_id])
        members[r.replica_id] = Member(r.replica_id, stage, "collective")
    for r in inline:
        stage = weightsync_pb2.StageEvent(manifest=inline_manifest, serve_mode=modes[r.replica_id])
        members[r.replica_id] = Member(r.replica_id, stage, "inline")
    trainer_manifest = broadcast_manifest if collective else _with_transport(record.manifest,
                                                                             inline_transport(settings))
    if mapped:
        assert shared_memory is not None
        mapped_manifest = _with_transport(record.manifest, common_pb2.Transport(shared_memory=shared_memory))
        for r in mapped:
            stage = weightsync_pb2.StageEvent(manifest=mapped_manifest, serve_mode=modes[r.replica_id])
            members[r.replica_id] = Member(r.replica_id, stage, "shared_memory")
        if not collective:  # the trainer sends nothing itself: its manifest says where the receivers read
            trainer_manifest = mapped_manifest
    round_ = Round(job.job_id, record.version, members, durable=record.durable)
    return PublishPlan(round_, trainer_manifest)


def plan_catch_up(settings: WeightSyncSettings, job: JobRecord, record: VersionRecord, replica: Replica) -> Round:
    """A one-replica round bringing a late or restarted replica to the active version, inline."""
    stage = weightsync_pb2.StageEvent(manifest=_with_transport(record.adapter, inline_transport(settings)),
                                      serve_mode=serve_mode(job.mode, replica.capabilities, job.spec.lora))
    return Round(job.job_id, record.version, {replica.replica_id: Member(replica.replica_id, stage, "inline")},
                 durable=record.durable, catch_up=True)
