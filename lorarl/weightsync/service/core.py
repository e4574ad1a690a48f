"""The weight-sync service's behaviour behind the gRPC servicer, as one object on one event loop.

Plain arguments in, plain results out (lorarl.weightsync.service.results), except the documents of the
wire format it stores and relays verbatim: a job's registration (with its catalog), manifests, a
replica's subscription, chunks.

It wires the plain parts together: the VersionRegistry (numbers, validation, durability), the
ReplicaDirectory (who is subscribed, with what), the planner (who gets which bytes how) and the
ActivationCoordinator (two-phase rounds). Every method runs on the server's event loop, so the
state needs no locks; only disk I/O of payloads goes to a worker thread. Replicas behind the active
version (late joiners, restarts, replicas left out of a round) are caught up inline from the
durable adapter, with a backoff when catching up fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

import grpc
import torch

from lorarl.common.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, ServiceError
from lorarl.common.validation import check_address, check_id
from lorarl.contract import versions
from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.service.config import WeightSyncSettings
from lorarl.weightsync.service.modes import choose_mode, registration_refusal
from lorarl.weightsync.service.planning import inline_transport, plan_catch_up, plan_publish, replica_blocker
from lorarl.weightsync.service.registry import JobRecord, VersionRecord, VersionRegistry
from lorarl.weightsync.service.replicas import Replica, ReplicaDirectory
from lorarl.weightsync.service.results import (
    ActivationResult,
    JobSyncStatus,
    Published,
    RegisteredJob,
    ReplicaSyncStatus,
)
from lorarl.weightsync.service.rounds import ACTIVE, FAILED, ActivationCoordinator, Round
from lorarl.weightsync.service.store import DurableStore
from lorarl.weightsync.wire.inline import BucketAssembler, iter_chunks
from lorarl.weightsync.wire.payload import PayloadError, PayloadVerifier

logger = logging.getLogger(__name__)

CACHED_PAYLOADS = 4
ROUNDS_KEPT = 64
RETRY_MIN_S, RETRY_MAX_S = 1.0, 60.0
MAX_SUBSCRIBED_JOBS = 1024


class DataLossError(ServiceError):
    """Stored bytes no longer match their manifest."""

    code = grpc.StatusCode.DATA_LOSS


class WeightSyncCore:
    """See the module docstring; the servicer translates messages to these calls and back."""

    def __init__(self, settings: WeightSyncSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self.store = DurableStore(settings.storage_dir)
        self.registry = VersionRegistry(self.store, settings.keep_versions)
        self.directory = ReplicaDirectory()
        self.coordinator = ActivationCoordinator(
            self.directory, stage_timeout_s=settings.stage_timeout_s, disconnect_grace_s=settings.disconnect_grace_s,
            on_commit=self.registry.set_active, on_done=self._round_done)
        self._rounds: dict[tuple[str, int], Round] = {}
        self._resolved: dict[tuple[str, int], asyncio.Event] = {}
        self._trainer_manifests: dict[tuple[str, int], common_pb2.WeightManifest] = {}
        self._payloads: OrderedDict[tuple[str, int], list[torch.Tensor]] = OrderedDict()
        self._retry: dict[tuple[str, str], tuple[float, float]] = {}
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Starts the timeout watchdog (call on the server's event loop)."""
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="weightsync-watchdog")

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        for replica in self.directory.replicas.values():
            if replica.connected and replica.outbox is not None:
                replica.outbox.put_nowait(None)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                self.coordinator.tick(self.clock())
                for job_id in list(self.registry.jobs):
                    self._reconcile(job_id)
            except Exception:
                logger.exception("weight-sync watchdog failed")

    # ---------------------------------------------------------------------------------- jobs

    def register_job(self, request: weightsync_pb2.RegisterJobRequest) -> RegisteredJob:
        self.registry.check_registration(request)
        caps = {r.replica_id: r.capabilities for r in self.directory.subscribers(request.job_id)}
        if why := registration_refusal(request.mode, request.lora, caps):
            raise FailedPreconditionError(f"job {request.job_id!r} cannot be served: {why}")
        job, new = self.registry.register(request, choose_mode(request.mode, request.lora, caps))
        if new:
            logger.info("registered job %s: %s", job.job_id, job.reason,
                        extra={"job_id": job.job_id, "mode": common_pb2.SyncMode.Name(job.mode)})
        return RegisteredJob(job.mode, job.reason, job.latest_version)

    # ------------------------------------------------------------------------------ versions

    def publish(self, manifest: common_pb2.WeightManifest, adapter: common_pb2.WeightManifest | None,
                sender_host: str, sender_port: int,
                shared_memory: common_pb2.SharedMemoryTransport | None = None) -> Published:
        """Accepts a version (``adapter``: its adapter form, for durability, when ``manifest`` is merged) and
        starts its round; the trainer sends by the returned manifest."""
        record, duplicate = self.registry.accept(manifest, adapter)
        job = self.registry.job(record.manifest.job_id)
        key = (job.job_id, record.version)
        if duplicate:
            return Published(self._trainer_manifests.get(key, record.manifest), duplicate=True)
        members = [r for r in self.directory.subscribers(job.job_id) if self._eligible(r, job)]
        plan = plan_publish(self.settings, job, record, members, sender_host, sender_port, shared_memory)
        self._remember(key, plan.round, plan.trainer_manifest)
        self.coordinator.submit(plan.round, self.clock())
        logger.info("accepted %s v%d (%s, %d bytes) for %d replicas", job.job_id, record.version,
                    common_pb2.SyncMode.Name(record.manifest.mode), record.manifest.total_bytes, len(members),
                    extra={"job_id": job.job_id, "version": record.version})
        return Published(plan.trainer_manifest)

    def _eligible(self, replica: Replica, job: JobRecord) -> bool:
        why = replica_blocker(replica, job)
        if why:
            replica.state(job.job_id).last_error = why
            return False
        return not any(r.catch_up and replica.replica_id in r.members and r.job_id == job.job_id
                       for r in self.coordinator.running)

    def _remember(self, key: tuple[str, int], round_: Round, manifest: common_pb2.WeightManifest) -> None:
        self._rounds[key], self._trainer_manifests[key] = round_, manifest
        self._resolved[key] = asyncio.Event()
        job_keys = sorted(k for k in self._rounds if k[0] == key[0])
        for old in job_keys[:-ROUNDS_KEPT]:
            for table in (self._rounds, self._trainer_manifests, self._resolved):
                table.pop(old, None)

    async def upload(self, job_id: str, version: int, chunks: AsyncIterator[common_pb2.WeightChunk]) -> int:
        """Stores a version's adapter bytes durably (verified), then lets its round commit; the bytes received."""
        if not versions.publishable(version):
            raise InvalidArgumentError("version", f"must be >= {versions.FIRST}")
        record = self.registry.version(job_id, version)
        assembler = BucketAssembler(record.adapter)
        verifier = PayloadVerifier(record.adapter)  # checks each chunk as it lands: no second pass at the end
        buffers: list[torch.Tensor] | None = None
        try:
            async for chunk in chunks:
                assembler.add(chunk)
                verifier.feed(chunk.bucket, assembler.buffers[chunk.bucket], chunk.offset,
                              chunk.offset + len(chunk.data))
            if not record.durable:  # a repeated upload of a durable version is accepted and ignored
                buffers = assembler.finish()
                tensors = verifier.finish()
                await asyncio.to_thread(self.store.save_adapter, record.adapter, buffers, tensors)
        except PayloadError as exc:
            raise InvalidArgumentError("chunk", str(exc)) from None
        if buffers is not None and not record.durable:
            record.durable = True
            self._cache((job_id, version), buffers)
            self.coordinator.set_durable(job_id, version, self.clock())
            self._reconcile(job_id)
        return assembler.received

    def _cache(self, key: tuple[str, int], buffers: list[torch.Tensor]) -> None:
        self._payloads[key] = buffers
        self._payloads.move_to_end(key)
        while len(self._payloads) > CACHED_PAYLOADS:
            self._payloads.popitem(last=False)

    async def _adapter_buffers(self, record: VersionRecord) -> list[torch.Tensor]:
        key = (record.manifest.job_id, record.version)
        buffers = self._payloads.get(key)
        if buffers is None:
            try:
                buffers = await asyncio.to_thread(self.store.load_adapter, key[0], key[1], record.adapter)
            except (OSError, PayloadError) as exc:
                raise DataLossError(f"stored adapter of {key[0]} v{key[1]} is unreadable: {exc}") from None
            self._cache(key, buffers)
        return buffers

    async def fetch(self, job_id: str, version: int, chunk_bytes: int = 0
                    ) -> AsyncIterator[common_pb2.WeightManifest | common_pb2.WeightChunk]:
        """The durable adapter of a version (0: the active one): its manifest, then its chunks."""
        record = self.registry.version(job_id, version)
        if not record.durable:
            raise FailedPreconditionError(f"the bytes of {job_id} v{record.version} are not uploaded yet")
        buffers = await self._adapter_buffers(record)
        chunk_bytes = min(chunk_bytes or self.settings.chunk_bytes, 64 << 20)
        manifest = common_pb2.WeightManifest()
        manifest.CopyFrom(record.adapter)
        manifest.transport.CopyFrom(inline_transport(self.settings))
        manifest.transport.inline.chunk_bytes = chunk_bytes
        yield manifest
        for chunk in iter_chunks(enumerate(buffers), chunk_bytes):
            yield chunk

    def get_manifest(self, job_id: str, version: int) -> common_pb2.WeightManifest:
        """The manifest as published (0: the active version)."""
        return self.registry.version(job_id, version).manifest

    async def await_activation(self, job_id: str, version: int, timeout_s: float) -> ActivationResult:
        """The version's outcome once resolved, or where it stands after ``timeout_s`` (0: at once)."""
        job = self.registry.job(job_id)
        key = (job.job_id, version)
        round_ = self._rounds.get(key)
        if round_ is None:
            if not (versions.publishable(version) and version <= job.latest_version):
                raise NotFoundError(f"job {job.job_id} has no version {version} "
                                    f"(latest {job.latest_version})", field="version")
            if version <= job.active_version:
                return ActivationResult(job.job_id, version, ACTIVE)
            return ActivationResult(
                job.job_id, version, FAILED,
                error="not activated before the weight-sync service restarted; publish the next version")
        if timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resolved[key].wait(), timeout_s)
        return round_.result()

    # ------------------------------------------------------------------------------ replicas

    def subscribe(self, request: weightsync_pb2.SubscribeRequest) -> Replica:
        """Registers the replica (a new stream replaces its old one) and catches it up."""
        check_id("replica_id", request.replica_id)
        if len(request.job_ids) > MAX_SUBSCRIBED_JOBS:
            raise InvalidArgumentError("job_ids", f"{len(request.job_ids)} jobs; a replica follows at most "
                                                  f"{MAX_SUBSCRIBED_JOBS}")
        for job_id in request.job_ids:
            check_id("job_ids", job_id)
        if request.serve_address:
            check_address("serve_address", request.serve_address)
        replica = self.directory.connect(request)
        logger.info("replica %s subscribed (%s, host %s, active %s)", replica.replica_id,
                    replica.capabilities.engine or "engine?", replica.host or "?", dict(request.active_versions),
                    extra={"replica_id": replica.replica_id})
        for job_id in list(self.registry.jobs):
            if replica.wants(job_id):
                self._retry.pop((replica.replica_id, job_id), None)
                self._reconcile(job_id)
        return replica

    def unsubscribe(self, replica_id: str, session: int) -> None:
        if self.directory.disconnect(replica_id, session):
            logger.info("replica %s disconnected", replica_id, extra={"replica_id": replica_id})
            self.coordinator.disconnected(replica_id, self.clock())

    def report_staged(self, replica_id: str, job_id: str, version: int, ok: bool, error: str = "") -> None:
        if not ok:
            logger.warning("replica %s failed to stage %s v%d: %s", replica_id, job_id, version, error,
                           extra={"replica_id": replica_id})
        self.coordinator.staged(replica_id, job_id, version, ok, error, self.clock())

    def report_active(self, replica_id: str, job_id: str, version: int) -> None:
        self.coordinator.activated(replica_id, job_id, version, self.clock())

    def _reconcile(self, job_id: str) -> None:
        """Starts a catch-up round for every idle subscriber behind the job's active version."""
        job = self.registry.jobs.get(job_id)
        if job is None or not job.active_version:
            return
        record = job.versions.get(job.active_version)
        if record is None or not record.durable:
            return
        now = self.clock()
        for replica in self.directory.subscribers(job_id):
            rid = replica.replica_id
            if (replica.state(job_id).active_version >= job.active_version or self.coordinator.busy(rid, job_id)
                    or replica_blocker(replica, job) or now < self._retry.get((rid, job_id), (0.0, 0.0))[0]):
                continue
            self.coordinator.submit(plan_catch_up(self.settings, job, record, replica), now)

    def _round_done(self, round_: Round) -> None:
        if round_.catch_up:
            (rid,) = round_.members
            if round_.outcome == FAILED:
                _, delay = self._retry.get((rid, round_.job_id), (0.0, RETRY_MIN_S / 2))
                delay = min(delay * 2, RETRY_MAX_S)
                self._retry[(rid, round_.job_id)] = (self.clock() + delay, delay)
            else:
                self._retry.pop((rid, round_.job_id), None)
        else:
            event = self._resolved.get((round_.job_id, round_.version))
            if event is not None:
                event.set()
        self._reconcile(round_.job_id)

    # -------------------------------------------------------------------------------- status

    def fleet(self) -> list[ReplicaSyncStatus]:
        """Every replica ever subscribed, job-independent: who serves, where (versions left 0)."""
        return [ReplicaSyncStatus(r.replica_id, 0, 0, r.connected, "", r.serve_address, r.capabilities)
                for _, r in sorted(self.directory.replicas.items())]

    def status(self, job_id: str = "") -> list[JobSyncStatus]:
        """Every job's versions and replicas ("": all jobs)."""
        jobs = [self.registry.job(job_id)] if job_id else [self.registry.jobs[j] for j in sorted(self.registry.jobs)]
        out = []
        for job in jobs:
            replicas = []
            for replica in self.directory.subscribers(job.job_id, connected_only=False):
                state = replica.state(job.job_id)
                replicas.append(ReplicaSyncStatus(replica.replica_id, state.active_version, state.staged_version,
                                                  replica.connected, state.last_error,
                                                  replica.serve_address))
            out.append(JobSyncStatus(job.job_id, job.latest_version, job.active_version, job.mode, job.reason,
                                     replicas))
        return out
