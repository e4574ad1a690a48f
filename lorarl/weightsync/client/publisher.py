"""The trainer side of weight sync: register a job, publish versions, learn whether they went live.

    async with WeightPublisher("weightsync:50053", token=...) as pub:
        await pub.register_job("job", base_model_fingerprint=fp, lora=spec, catalog=catalog_from_tensors(
            iter_merged_weights(model, merge=False)), mode=SYNC_MODE_AUTO)
        result = await pub.publish("job", step, adapter=peft_state_dict(model),
                                   merged=lambda: iter_merged_weights(model))
        result.activation.ok    # every replica of the round serves `step`

publish() packs the payload into buckets (checksummed), asks the service for a rendezvous
(PublishManifest, reporting this host and the port of a rendezvous store it already listens on),
then at the same time broadcasts the buckets to the replicas over a WeightTransferGroup and uploads
the adapter inline as the durable copy, and finally waits for the two-phase outcome. Which payload
goes out follows the job's mode: the adapter, or for MERGED jobs the merged weights (produced by
the `merged` factory only then) plus the adapter for durability. A merged payload bigger than
`materialize_limit_bytes` is packed twice (once for the manifest's checksums, once while sending)
instead of being held whole in memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
import torch.distributed as dist

from lorarl.common.channel import ClientTls, aio_channel
from lorarl.platform.shared_memory import write_buffers
from lorarl.v1 import common_pb2, weightsync_pb2, weightsync_pb2_grpc
from lorarl.weightsync.client.activation import await_outcome
from lorarl.weightsync.wire import sizes
from lorarl.weightsync.wire.collective import BACKEND_NAMES, WeightTransferGroup, rendezvous_store, wait_closed
from lorarl.weightsync.wire.inline import DEFAULT_CHUNK_BYTES, iter_chunks
from lorarl.weightsync.wire.net import local_address_towards
from lorarl.weightsync.wire.payload import (
    DEFAULT_BUCKET_BYTES,
    BucketInfo,
    PackedBucket,
    bucket_mac,
    build_manifest,
    pack,
    transfer_key,
    version_fingerprint,
)

logger = logging.getLogger(__name__)
#: How long one watch of a broadcast's round asks weight sync to hold its answer.
ROUND_WATCH_S = 5.0
MATERIALIZE_LIMIT_BYTES = sizes.MATERIALIZE_LIMIT_BYTES

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
ADAPTER = common_pb2.SYNC_MODE_ADAPTER
MERGED = common_pb2.SYNC_MODE_MERGED
ACTIVE = weightsync_pb2.ACTIVATION_OUTCOME_ACTIVE


class PublishError(RuntimeError):
    """Weight sync refused a publish, or its bytes could not be delivered; ``code`` is the grpc status
    behind it, if any (UNAVAILABLE: weight sync was unreachable or restarting, worth retrying)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class JobRegistration:
    job_id: str
    mode: int  # ADAPTER or MERGED (AUTO resolved by the service)
    reason: str
    latest_version: int
    base_model_fingerprint: str
    lora: common_pb2.LoraSpec


@dataclass(frozen=True)
class ActivationResult:
    """The two-phase outcome of one version (AwaitActivationResponse, as Python)."""

    job_id: str
    version: int
    outcome: int
    error: str = ""
    failed_replicas: tuple[str, ...] = ()
    replicas: tuple[weightsync_pb2.ReplicaActivation, ...] = ()

    @property
    def ok(self) -> bool:
        return self.outcome == ACTIVE

    @property
    def outcome_name(self) -> str:
        return weightsync_pb2.ActivationOutcome.Name(self.outcome).removeprefix("ACTIVATION_OUTCOME_").lower()

    @classmethod
    def from_proto(cls, r: weightsync_pb2.AwaitActivationResponse) -> ActivationResult:
        return cls(r.job_id, r.version, r.outcome, r.error, tuple(r.failed_replicas), tuple(r.replicas))


@dataclass
class PublishResult:
    job_id: str
    version: int
    mode: int
    duplicate: bool
    transport: str  # "collective", "inline" or "shared_memory" (co-located replicas map this trainer's file)
    receivers: int  # replicas in the collective group
    payload_bytes: int  # bytes of the published payload (broadcast to each collective receiver)
    uploaded_bytes: int  # durable adapter bytes sent to the service
    send_error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    activation: ActivationResult | None = None
    #: The version's fingerprints (version_fingerprint): its adapter's, and its merged weights' in a merged job
    #: (a replica serves one or the other, or merges the adapter itself).
    fingerprints: tuple[str, ...] = ()


def _pairs(tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(tensors.items()) if isinstance(tensors, Mapping) else iter(tensors)


class _Payload:
    """Packed buckets of one payload: kept in memory, or re-packed from a factory when too big."""

    def __init__(self, source: Callable[[], NamedTensors], bucket_bytes: int, limit_bytes: int,
                 seal: Callable[[PackedBucket], bytes]) -> None:
        """``seal``: a bucket's MAC, computed while its bytes are at hand (they may not be kept)."""
        self._source, self._bucket_bytes = source, bucket_bytes
        self.infos: list[BucketInfo] = []
        kept: list[PackedBucket] | None = []
        for bucket in pack(_pairs(source()), bucket_bytes):
            self.infos.append(BucketInfo(bucket.index, bucket.nbytes, bucket.checksum, bucket.specs, seal(bucket)))
            if kept is not None:
                kept.append(bucket)
                if sum(b.nbytes for b in kept) > limit_bytes:
                    kept = None  # too big to hold: drop, re-pack while sending
        self._kept = kept

    @property
    def materialized(self) -> bool:
        return self._kept is not None

    def buckets(self) -> Iterator[PackedBucket]:
        return iter(self._kept) if self._kept is not None else pack(_pairs(self._source()), self._bucket_bytes)


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` on a daemon thread of its own, as a future of this loop. Unlike asyncio.to_thread, a call
    given up on (a broadcast whose round failed) holds no executor slot and no shutdown: asyncio.run and the
    service's exit would otherwise join it until its collective timeout."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(outcome: Any, failed: bool) -> None:
        if not future.done():
            (future.set_exception if failed else future.set_result)(outcome)

    def run() -> None:
        try:
            outcome, failed = fn(*args), False
        except BaseException as error:  # handed to the awaiting coroutine
            outcome, failed = error, True
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome, failed)

    threading.Thread(target=run, name=f"lorarl-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


class WeightPublisher:
    """Client of WeightSyncService for a trainer (see module docstring).

    host: the address replicas reach this trainer at (the collective group's master); default: the
    local address of the route to the service. collective=False: inline only (no group is formed).
    colocation_id: this trainer computes on a shared base (placement.colocate): each payload is also put in a
    memory file of this process that co-located replicas map (lorarl.platform.shared_memory), kept open for the
    last ``KEPT_MEMORY_FILES`` versions of each job (a queued round still finds its file).
    """

    KEPT_MEMORY_FILES = 8

    def __init__(self, target: str, *, token: str | None = None, tls: ClientTls | None = None,
                 host: str | None = None, collective: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: str = "cpu",
                 materialize_limit_bytes: int = MATERIALIZE_LIMIT_BYTES, rendezvous_timeout_s: float = 120.0,
                 colocation_id: str = "") -> None:
        self.target, self.token = target, token
        self.colocation_id = colocation_id
        self._memory_files: dict[str, collections.deque[int]] = {}
        self.host = host or local_address_towards(target)
        self.collective, self.bucket_bytes, self.chunk_bytes = collective, bucket_bytes, chunk_bytes
        self.device, self.materialize_limit_bytes = device, materialize_limit_bytes
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self._channel = aio_channel(target, token=token, tls=tls)
        self.stub = weightsync_pb2_grpc.WeightSyncServiceStub(self._channel)
        self.jobs: dict[str, JobRegistration] = {}
        self._store: dist.TCPStore | None = None

    def connect(self) -> None:
        """Starts connecting to the service without waiting, so the first publish finds the channel up."""
        self._channel.get_state(try_to_connect=True)

    async def __aenter__(self) -> WeightPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel and waits for transfer groups still closing in the background, so the
        process can exit right after (see collective.wait_closed)."""
        await self._channel.close()
        await asyncio.to_thread(wait_closed)
        self._store = None
        for files in self._memory_files.values():
            for fd in files:
                os.close(fd)
        self._memory_files.clear()

    # ---------------------------------------------------------------------------------- jobs

    async def register_job(self, job_id: str, *, base_model_fingerprint: str, lora: common_pb2.LoraSpec,
                           catalog: weightsync_pb2.ModelCatalog, mode: int = common_pb2.SYNC_MODE_AUTO,
                           start_version: int = 0) -> JobRegistration:
        """Registers (or re-attaches to) a job; the answer says the resolved mode, why, and the latest version."""
        response = await self.stub.RegisterJob(weightsync_pb2.RegisterJobRequest(
            job_id=job_id, base_model_fingerprint=base_model_fingerprint, lora=lora, mode=mode, catalog=catalog,
            start_version=start_version),
            timeout=60)
        registration = JobRegistration(job_id, response.mode, response.reason, response.latest_version,
                                       base_model_fingerprint, lora)
        self.jobs[job_id] = registration
        logger.info("job %s syncs %s: %s", job_id, common_pb2.SyncMode.Name(response.mode), response.reason)
        return registration

    # ------------------------------------------------------------------------------ publish

    async def publish(self, job_id: str, version: int, *, adapter: NamedTensors | Callable[[], NamedTensors],
                      merged: Callable[[], NamedTensors] | None = None, wait: bool = True,
                      timeout_s: float = 600.0) -> PublishResult:
        """Publishes `version` (latest + 1) and delivers it; with wait, also returns the activation outcome.

        Raises PublishError when the service refuses the manifest or the durable upload fails. A
        failed broadcast is not raised: the replicas report it, and the outcome says FAILED.
        """
        job = self.jobs.get(job_id)
        if job is None:
            raise PublishError(f"register job {job_id!r} before publishing")
        timings: dict[str, float] = {}
        started = time.perf_counter()
        if job.mode == MERGED and merged is None:
            raise PublishError(f"job {job_id} syncs merged weights: pass merged=<factory of (name, tensor)>")
        adapter_source = adapter if callable(adapter) else (lambda: adapter)
        key = transfer_key(self.token, job_id)

        def sealer(mode: int) -> Callable[[PackedBucket], bytes]:
            return lambda bucket: bucket_mac(key, version, mode, bucket.index, bucket.buffer)

        # Packing, checksums and MACs run in a worker thread: the caller's event loop stays responsive.
        adapter_payload = await asyncio.to_thread(_Payload, adapter_source, self.bucket_bytes, 1 << 62,
                                                  sealer(ADAPTER))
        adapter_manifest = self._manifest(job, version, ADAPTER, adapter_payload, key)
        payload, manifest = adapter_payload, adapter_manifest
        if job.mode == MERGED:
            assert merged is not None
            payload = await asyncio.to_thread(_Payload, merged, self.bucket_bytes, self.materialize_limit_bytes,
                                              sealer(MERGED))
            manifest = self._manifest(job, version, MERGED, payload, key)
        timings["pack_s"] = time.perf_counter() - started

        request = weightsync_pb2.PublishManifestRequest(manifest=manifest)
        if job.mode == MERGED:
            request.adapter.CopyFrom(adapter_manifest)
        if self.colocation_id:
            started_copy = time.perf_counter()
            fd, _ = await asyncio.to_thread(write_buffers, [b.buffer for b in payload.buckets()])
            self._keep_memory_file(job_id, fd)
            request.shared_memory.CopyFrom(common_pb2.SharedMemoryTransport(colocation_id=self.colocation_id,
                                                                            pid=os.getpid(), fd=fd))
            timings["shared_memory_s"] = time.perf_counter() - started_copy
        if self.collective:
            request.sender_host, request.sender_port = self.host, await self._rendezvous_port()
        try:
            response = await self.stub.PublishManifest(request, timeout=60)
        except grpc.aio.AioRpcError as exc:
            raise PublishError(f"{job_id} v{version} refused: {exc.code().name}: {exc.details()}", exc.code()) from exc
        timings["publish_rpc_s"] = time.perf_counter() - started - timings["pack_s"]
        accepted = response.manifest
        is_collective = accepted.transport.WhichOneof("kind") == "collective"
        receivers = accepted.transport.collective.world_size - 1 if is_collective else 0
        result = PublishResult(job_id, version, manifest.mode, response.duplicate,
                               accepted.transport.WhichOneof("kind") or "inline", receivers, manifest.total_bytes,
                               0, timings=timings, fingerprints=tuple(dict.fromkeys(
                                   version_fingerprint(m) for m in (adapter_manifest, manifest))))
        if not response.duplicate:
            await self._deliver(accepted, response.sender_rank, payload, adapter_payload, adapter_manifest, result)
        if wait:
            waited = time.perf_counter()
            result.activation = await self.await_activation(job_id, version, timeout_s)
            timings["activation_wait_s"] = time.perf_counter() - waited
        timings["total_s"] = time.perf_counter() - started
        return result

    def _keep_memory_file(self, job_id: str, fd: int) -> None:
        files = self._memory_files.setdefault(job_id, collections.deque())
        files.append(fd)
        while len(files) > self.KEPT_MEMORY_FILES:
            os.close(files.popleft())

    def _manifest(self, job: JobRegistration, version: int, mode: int, payload: _Payload, key: bytes
                  ) -> common_pb2.WeightManifest:
        return build_manifest(job_id=job.job_id, version=version, mode=mode,
                              base_model_fingerprint=job.base_model_fingerprint, buckets=payload.infos,
                              lora=job.lora, key=key)

    async def _rendezvous_port(self) -> int:
        if self._store is None:
            self._store = await asyncio.to_thread(rendezvous_store, self.host, self.rendezvous_timeout_s)
        return self._store.port

    async def _deliver(self, accepted: common_pb2.WeightManifest, sender_rank: int, payload: _Payload,
                       adapter_payload: _Payload, adapter_manifest: common_pb2.WeightManifest,
                       result: PublishResult) -> None:
        """Broadcast (if any receiver) and durable upload, side by side."""
        t0 = time.perf_counter()

        async def broadcast() -> None:
            if result.receivers > 0:
                await self._send_while_round_lives(accepted, sender_rank, payload)
                result.timings["send_s"] = time.perf_counter() - t0

        async def upload() -> None:
            response = await self.stub.UploadWeights(self._upload_requests(adapter_manifest, adapter_payload),
                                                     timeout=600)
            result.uploaded_bytes = response.bytes_received
            result.timings["upload_s"] = time.perf_counter() - t0

        sent, uploaded = await asyncio.gather(broadcast(), upload(), return_exceptions=True)
        if isinstance(sent, BaseException):
            result.send_error = f"{type(sent).__name__}: {sent}"
            logger.warning("broadcast of %s v%d failed: %s", accepted.job_id, accepted.version, result.send_error)
        if isinstance(uploaded, BaseException):
            detail = (f"{uploaded.code().name}: {uploaded.details()}" if isinstance(uploaded, grpc.aio.AioRpcError)
                      else repr(uploaded))
            code = uploaded.code() if isinstance(uploaded, grpc.aio.AioRpcError) else None
            raise PublishError(f"upload of {accepted.job_id} v{accepted.version} failed: {detail}", code) from uploaded

    async def _send_while_round_lives(self, accepted: common_pb2.WeightManifest, sender_rank: int,
                                      payload: _Payload) -> int:
        """The broadcast, given up as soon as weight sync fails its round: a receiver that died before it joined
        the rendezvous would otherwise hold the sender for the whole collective timeout (120 s by default)
        while weight sync already knows the version failed. The abandoned send thread ends at that timeout on
        its own (a daemon thread: nothing waits for it, at exit either); its group is never used again."""
        sending = in_daemon_thread(self._broadcast, accepted, sender_rank, payload)
        watching = asyncio.ensure_future(self._round_failure(accepted.job_id, accepted.version))
        try:
            done, _ = await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
        if sending in done:
            return sending.result()
        failure = watching.result() if not watching.cancelled() else "failed"
        raise RuntimeError(f"weight sync failed the round while this send was under way: {failure}")

    async def _round_failure(self, job_id: str, version: int) -> str:
        """Returns the version's failure once weight sync settles it as failed; never returns while it lives or
        activates (the send then ends by itself)."""
        while True:
            try:
                outcome = await await_outcome(self.stub, job_id, version, ROUND_WATCH_S)
            except grpc.aio.AioRpcError:  # weight sync unreachable: the send's own timeout stays the bound
                await asyncio.sleep(ROUND_WATCH_S)
                continue
            if outcome.outcome == weightsync_pb2.ACTIVATION_OUTCOME_FAILED:
                return outcome.error or "failed"
            if outcome.outcome == weightsync_pb2.ACTIVATION_OUTCOME_ACTIVE:
                await asyncio.Event().wait()  # active: the send is about to end; nothing to watch

    def _broadcast(self, accepted: common_pb2.WeightManifest, sender_rank: int, payload: _Payload) -> int:
        c = accepted.transport.collective
        group = WeightTransferGroup(BACKEND_NAMES[c.backend], c.master_address, c.master_port, sender_rank,
                                    c.world_size, c.group_name, timeout_s=c.timeout_seconds or 120,
                                    device=self.device, local_address=self.host, store=self._store)
        try:
            return group.send(payload.buckets(), src=sender_rank)
        finally:
            group.close(wait=False)

    async def _upload_requests(self, manifest: common_pb2.WeightManifest, payload: _Payload
                               ) -> AsyncIterator[weightsync_pb2.UploadWeightsRequest]:
        yield weightsync_pb2.UploadWeightsRequest(job_id=manifest.job_id, version=manifest.version)
        for chunk in iter_chunks(((b.index, b.buffer) for b in payload.buckets()), self.chunk_bytes):
            yield weightsync_pb2.UploadWeightsRequest(chunk=chunk, version=manifest.version)

    # ------------------------------------------------------------------------------ outcome

    async def await_activation(self, job_id: str, version: int, timeout_s: float = 600.0) -> ActivationResult:
        """Waits for the version's two-phase outcome (PENDING if `timeout_s` runs out first); rides out a
        weight-sync restart (UNAVAILABLE) until then."""
        return ActivationResult.from_proto(await await_outcome(self.stub, job_id, version, timeout_s))

    async def status_now(self, timeout_s: float = 5.0) -> weightsync_pb2.GetSyncStatusResponse:
        """Every job and the fleet (each replica's capabilities), or the call's error within ``timeout_s``."""
        return await self.stub.GetSyncStatus(weightsync_pb2.GetSyncStatusRequest(), timeout=timeout_s)

    async def status(self, job_id: str = "") -> weightsync_pb2.GetSyncStatusResponse:
        return await self.stub.GetSyncStatus(weightsync_pb2.GetSyncStatusRequest(job_id=job_id), timeout=30)
