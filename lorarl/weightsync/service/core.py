"""The weight-sync service's behaviour behind the gRPC servicer, as one object on one event loop.

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
from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.service.config import WeightSyncSettings
from lorarl.weightsync.service.modes import choose_mode
from lorarl.weightsync.service.planning import fingerprint_blocker, inline_transport, plan_catch_up, plan_publish
from lorarl.weightsync.service.registry import JobRecord, VersionRecord, VersionRegistry
from lorarl.weightsync.service.replicas import Replica, ReplicaDirectory
from lorarl.weightsync.service.rounds import ACTIVE, FAILED, ActivationCoordinator, Round
from lorarl.weightsync.service.store import DurableStore
from lorarl.weightsync.wire.inline import BucketAssembler, iter_chunks
from lorarl.weightsync.wire.payload import PayloadError, PayloadVerifier

logger = logging.getLogger(__name__)

CACHED_PAYLOADS = 4
ROUNDS_KEPT = 64
RETRY_MIN_S, RETRY_MAX_S = 1.0, 60.0


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

    def register_job(self, request: weightsync_pb2.RegisterJobRequest) -> weightsync_pb2.RegisterJobResponse:
        self.registry.check_registration(request)
        caps = {r.replica_id: r.capabilities for r in self.directory.subscribers(request.job_id)}
        job, new = self.registry.register(request, choose_mode(request.mode, request.lora, caps))
        if new:
            logger.info("registered job %s: %s", job.job_id, job.reason,
                        extra={"job_id": job.job_id, "mode": common_pb2.SyncMode.Name(job.mode)})
        return weightsync_pb2.RegisterJobResponse(mode=job.mode, reason=job.reason, latest_version=job.latest_version)

    # ------------------------------------------------------------------------------ versions

    def publish(self, request: weightsync_pb2.PublishManifestRequest) -> weightsync_pb2.PublishManifestResponse:
        adapter = request.adapter if request.HasField("adapter") else None
        record, duplicate = self.registry.accept(request.manifest, adapter)
        job = self.registry.job(record.manifest.job_id)
        key = (job.job_id, record.version)
        if duplicate:
            manifest = self._trainer_manifests.get(key, record.manifest)
            return weightsync_pb2.PublishManifestResponse(manifest=manifest, sender_rank=0, duplicate=True)
        members = [r for r in self.directory.subscribers(job.job_id) if self._eligible(r, job)]
        plan = plan_publish(self.settings, job, record, members, request.sender_host, request.sender_port)
        self._remember(key, plan.round, plan.trainer_manifest)
        self.coordinator.submit(plan.round, self.clock())
        logger.info("accepted %s v%d (%s, %d bytes) for %d replicas", job.job_id, record.version,
                    common_pb2.SyncMode.Name(record.manifest.mode), record.manifest.total_bytes, len(members),
                    extra={"job_id": job.job_id, "version": record.version})
        return weightsync_pb2.PublishManifestResponse(manifest=plan.trainer_manifest, sender_rank=0)

    def _eligible(self, replica: Replica, job: JobRecord) -> bool:
        why = fingerprint_blocker(replica, job)
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

    async def upload(self, requests: AsyncIterator[weightsync_pb2.UploadWeightsRequest]
                     ) -> weightsync_pb2.UploadWeightsResponse:
        """Stores a version's adapter bytes durably (verified), then lets its round commit."""
        first = await anext(requests, None)
        if first is None or first.WhichOneof("payload") != "job_id":
            raise InvalidArgumentError("job_id", "the first UploadWeights message must name the job")
        if first.version < 1:
            raise InvalidArgumentError("version", "must be >= 1")
        record = self.registry.version(first.job_id, first.version)
        assembler = BucketAssembler(record.adapter)
        verifier = PayloadVerifier(record.adapter)  # checks each chunk as it lands: no second pass at the end
        buffers: list[torch.Tensor] | None = None
        try:
            async for request in requests:
                if request.WhichOneof("payload") != "chunk":
                    raise InvalidArgumentError("chunk", "only chunks may follow the first message")
                chunk = request.chunk
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
            self._cache((first.job_id, first.version), buffers)
            self.coordinator.set_durable(first.job_id, first.version, self.clock())
            self._reconcile(first.job_id)
        return weightsync_pb2.UploadWeightsResponse(bytes_received=assembler.received)

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

    async def fetch(self, request: weightsync_pb2.FetchWeightsRequest
                    ) -> AsyncIterator[weightsync_pb2.FetchWeightsResponse]:
        """The durable adapter of a version (0: the active one): its manifest, then its chunks."""
        record = self.registry.version(request.job_id, request.version)
        if not record.durable:
            raise FailedPreconditionError(f"the bytes of {request.job_id} v{record.version} are not uploaded yet")
        buffers = await self._adapter_buffers(record)
        chunk_bytes = min(request.chunk_bytes or self.settings.chunk_bytes, 64 << 20)
        manifest = common_pb2.WeightManifest()
        manifest.CopyFrom(record.adapter)
        manifest.transport.CopyFrom(inline_transport(self.settings))
        manifest.transport.inline.chunk_bytes = chunk_bytes
        yield weightsync_pb2.FetchWeightsResponse(manifest=manifest)
        for chunk in iter_chunks(enumerate(buffers), chunk_bytes):
            yield weightsync_pb2.FetchWeightsResponse(chunk=chunk)

    def get_manifest(self, request: weightsync_pb2.GetManifestRequest) -> weightsync_pb2.GetManifestResponse:
        """The manifest as published (0: the active version)."""
        return weightsync_pb2.GetManifestResponse(manifest=self.registry.version(request.job_id,
                                                                                 request.version).manifest)

    async def await_activation(self, request: weightsync_pb2.AwaitActivationRequest
                               ) -> weightsync_pb2.AwaitActivationResponse:
        job = self.registry.job(request.job_id)
        key = (job.job_id, request.version)
        round_ = self._rounds.get(key)
        if round_ is None:
            if not 1 <= request.version <= job.latest_version:
                raise NotFoundError(f"job {job.job_id} has no version {request.version} "
                                    f"(latest {job.latest_version})", field="version")
            if request.version <= job.active_version:
                return weightsync_pb2.AwaitActivationResponse(job_id=job.job_id, version=request.version,
                                                              outcome=ACTIVE)
            return weightsync_pb2.AwaitActivationResponse(
                job_id=job.job_id, version=request.version, outcome=FAILED,
                error="not activated before the weight-sync service restarted; publish the next version")
        if request.timeout_seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resolved[key].wait(), request.timeout_seconds)
        return round_.response()

    # ------------------------------------------------------------------------------ replicas

    def subscribe(self, request: weightsync_pb2.SubscribeRequest) -> Replica:
        """Registers the replica (a new stream replaces its old one) and catches it up."""
        if not request.replica_id:
            raise InvalidArgumentError("replica_id", "is empty")
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

    def report_staged(self, request: weightsync_pb2.ReportStagedRequest) -> None:
        if not request.ok:
            logger.warning("replica %s failed to stage %s v%d: %s", request.replica_id, request.job_id,
                           request.version, request.error, extra={"replica_id": request.replica_id})
        self.coordinator.staged(request.replica_id, request.job_id, request.version, request.ok, request.error,
                                self.clock())

    def report_active(self, request: weightsync_pb2.ReportActiveRequest) -> None:
        self.coordinator.activated(request.replica_id, request.job_id, request.version, self.clock())

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
                    or fingerprint_blocker(replica, job) or now < self._retry.get((rid, job_id), (0.0, 0.0))[0]):
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

    def status(self, request: weightsync_pb2.GetSyncStatusRequest) -> weightsync_pb2.GetSyncStatusResponse:
        if request.job_id:
            jobs = [self.registry.job(request.job_id)]
        else:
            jobs = [self.registry.jobs[j] for j in sorted(self.registry.jobs)]
        response = weightsync_pb2.GetSyncStatusResponse()
        for job in jobs:
            entry = response.jobs.add(job_id=job.job_id, latest_version=job.latest_version, mode=job.mode,
                                      active_version=job.active_version, mode_reason=job.reason)
            for replica in self.directory.subscribers(job.job_id, connected_only=False):
                state = replica.state(job.job_id)
                entry.replicas.add(replica_id=replica.replica_id, active_version=state.active_version,
                                   staged_version=state.staged_version, connected=replica.connected,
                                   last_error=state.last_error)
        return response
