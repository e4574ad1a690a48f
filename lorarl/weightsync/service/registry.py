"""The version registry: which jobs exist, which versions were published, which one is active.

Versions move only forward: a publish must be latest + 1 (a gap is FAILED_PRECONDITION), a repeat
of an accepted version with the same content is an idempotent duplicate, anything else under an
existing number is ALREADY_EXISTS. The registry writes through to a DurableStore (when given), so
a restarted service resumes with the same jobs and numbers. It holds no I/O-heavy payloads; the
caller writes adapter bytes through the store and then calls `set_durable`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import xxhash

from lorarl.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from lorarl.common.validation import check_id, check_version
from lorarl.contract import versions
from lorarl.contract.errors import SpecError
from lorarl.contract.lora import LoraSpec
from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.service.modes import ADAPTER, AUTO, MERGED, ModeChoice
from lorarl.weightsync.service.store import DurableStore
from lorarl.weightsync.wire.catalog import JobCatalog
from lorarl.weightsync.wire.payload import PayloadError, manifest_digest, validate_manifest

logger = logging.getLogger(__name__)



@dataclass
class VersionRecord:
    """One accepted version: the manifest as published, the adapter kept durably, its identity."""

    manifest: common_pb2.WeightManifest
    adapter: common_pb2.WeightManifest
    digest: int
    durable: bool = False

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass
class JobRecord:
    request: weightsync_pb2.RegisterJobRequest
    spec: JobCatalog
    mode: int
    reason: str
    latest_version: int = 0
    active_version: int = 0
    versions: dict[int, VersionRecord] = field(default_factory=dict)

    @property
    def job_id(self) -> str:
        return self.request.job_id


def payload_digest(manifest: common_pb2.WeightManifest, adapter: common_pb2.WeightManifest | None) -> int:
    """Identity of a publish: the payload's digest, and the adapter's for merged jobs."""
    h = xxhash.xxh64()
    h.update(manifest_digest(manifest).to_bytes(8, "little"))
    if adapter is not None and adapter is not manifest:
        h.update(manifest_digest(adapter).to_bytes(8, "little"))
    return h.intdigest()


def _check_payload(manifest: common_pb2.WeightManifest, field: str) -> None:
    try:
        validate_manifest(manifest)
    except PayloadError as exc:
        raise InvalidArgumentError(field, str(exc)) from None


def _same_job(a: weightsync_pb2.RegisterJobRequest, b: weightsync_pb2.RegisterJobRequest) -> bool:
    """Same job identity; start_version is a position in its history, not part of its identity."""
    a, b = _without_start(a), _without_start(b)
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def _without_start(request: weightsync_pb2.RegisterJobRequest) -> weightsync_pb2.RegisterJobRequest:
    copy = weightsync_pb2.RegisterJobRequest()
    copy.CopyFrom(request)
    copy.start_version = 0
    return copy


class VersionRegistry:
    """Jobs and their versions; every rule of the module docstring is enforced here."""

    def __init__(self, store: DurableStore | None = None, keep_versions: int = 3) -> None:
        self.store = store
        self.keep_versions = keep_versions
        self.jobs: dict[str, JobRecord] = {}
        if store is not None:
            self._load(store)

    def _load(self, store: DurableStore) -> None:
        for job_id, stored in store.load().items():
            spec = JobCatalog(job_id, stored.request.base_model_fingerprint, stored.request.lora,
                              stored.request.catalog)
            job = JobRecord(stored.request, spec, stored.mode, stored.reason, active_version=stored.active_version)
            for v, sv in stored.versions.items():
                adapter = sv.adapter if stored.mode == MERGED else None
                job.versions[v] = VersionRecord(sv.manifest, sv.adapter, payload_digest(sv.manifest, adapter),
                                                sv.durable)
            job.latest_version = max([job.active_version, stored.request.start_version, *job.versions])
            self.jobs[job_id] = job
            logger.info("reloaded job %s: latest version %d, active %d", job_id, job.latest_version,
                        job.active_version, extra={"job_id": job_id})

    # ---------------------------------------------------------------------------------- jobs

    def job(self, job_id: str, field: str = "job_id") -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r} is registered", field=field)
        return job

    @staticmethod
    def check_registration(request: weightsync_pb2.RegisterJobRequest) -> None:
        check_id("job_id", request.job_id)
        check_version("start_version", request.start_version)
        if not request.base_model_fingerprint:
            raise InvalidArgumentError("base_model_fingerprint", "is empty")
        if request.lora.rank < 1:
            # A registration describes tensors that exist, so it states their rank: the spec's "0 = the
            # default rank" (lorarl.contract.lora) applies to a job being created, not to one being described.
            raise InvalidArgumentError("lora.rank", "must be >= 1: the rank of the adapter the trainer holds "
                                                    "(merged jobs also keep the adapter)")
        try:
            LoraSpec.from_proto(request.lora)
        except SpecError as exc:
            raise InvalidArgumentError(exc.path, exc.problem) from None
        if request.mode not in (ADAPTER, MERGED, AUTO):
            raise InvalidArgumentError("mode", "must be ADAPTER, MERGED or AUTO")
        if not request.catalog.tensors:
            raise InvalidArgumentError("catalog.tensors", "is empty")
        names = [t.name for t in request.catalog.tensors]
        if len(set(names)) != len(names):
            raise InvalidArgumentError("catalog.tensors", "has duplicate names")

    def register(self, request: weightsync_pb2.RegisterJobRequest, choice: ModeChoice) -> tuple[JobRecord, bool]:
        """Adds a job (or returns the identical one already registered); True when it is new."""
        self.check_registration(request)
        existing = self.jobs.get(request.job_id)
        if existing is not None:
            if not _same_job(existing.request, request):
                raise AlreadyExistsError(f"job {request.job_id!r} is already registered with a different "
                                         "fingerprint, LoRA spec, mode or catalog")
            if request.start_version > existing.latest_version:
                existing.latest_version = request.start_version
                existing.request.start_version = request.start_version
                if self.store is not None:
                    self.store.save_job(existing.request, existing.mode, existing.reason)
            return existing, False
        if choice.mode not in (ADAPTER, MERGED):
            raise ValueError("the mode choice must be resolved")
        spec = JobCatalog(request.job_id, request.base_model_fingerprint, request.lora, request.catalog)
        job = JobRecord(request, spec, choice.mode, choice.reason)
        job.latest_version = request.start_version
        if self.store is not None:
            self.store.save_job(request, choice.mode, choice.reason)
        self.jobs[request.job_id] = job
        return job, True

    # ------------------------------------------------------------------------------ versions

    def accept(self, manifest: common_pb2.WeightManifest, adapter: common_pb2.WeightManifest | None
               ) -> tuple[VersionRecord, bool]:
        """Validates a publish; returns (record, duplicate). Raises the statuses in the module docstring."""
        job = self.job(manifest.job_id, field="manifest.job_id")
        _check_payload(manifest, "manifest")
        if manifest.base_model_fingerprint != job.spec.fingerprint:
            raise FailedPreconditionError(
                f"manifest.base_model_fingerprint {manifest.base_model_fingerprint!r} is not the job's base model "
                f"{job.spec.fingerprint!r}", field="manifest.base_model_fingerprint")
        if not versions.publishable(manifest.version):
            raise InvalidArgumentError("manifest.version", f"versions start at {versions.FIRST}")
        if manifest.mode != job.mode:
            raise InvalidArgumentError("manifest.mode", f"job {job.job_id} syncs {common_pb2.SyncMode.Name(job.mode)},"
                                                        f" got {common_pb2.SyncMode.Name(manifest.mode)}")
        job.spec.check(manifest, "manifest")
        durable = self._durable_adapter(job, manifest, adapter)
        digest = payload_digest(manifest, durable if job.mode == MERGED else None)

        if manifest.version <= job.latest_version:
            known = job.versions.get(manifest.version)
            if known is not None and known.digest == digest:
                return known, True
            if known is not None:
                raise AlreadyExistsError(f"version {manifest.version} of job {job.job_id} was already published "
                                         "with different content", field="manifest.version")
            raise AlreadyExistsError(f"version {manifest.version} is older than the latest version "
                                     f"{job.latest_version}", field="manifest.version")
        expected = versions.next_version(job.latest_version)
        if manifest.version != expected:
            raise FailedPreconditionError(f"version gap: latest is {job.latest_version}, so the next version is "
                                          f"{expected}, got {manifest.version}", field="manifest.version")

        stored = common_pb2.WeightManifest()
        stored.CopyFrom(manifest)
        stored.ClearField("transport")
        kept = stored
        if durable is not manifest:
            kept = common_pb2.WeightManifest()
            kept.CopyFrom(durable)
            kept.ClearField("transport")
        record = VersionRecord(stored, kept, digest)
        if self.store is not None:
            self.store.save_manifests(stored, kept)
        job.versions[manifest.version] = record
        job.latest_version = manifest.version
        self._prune(job)
        return record, False

    @staticmethod
    def _durable_adapter(job: JobRecord, manifest: common_pb2.WeightManifest,
                         adapter: common_pb2.WeightManifest | None) -> common_pb2.WeightManifest:
        """The adapter kept on disk: the manifest itself (ADAPTER jobs) or the one sent beside it (MERGED)."""
        if job.mode == ADAPTER:
            if adapter is not None:
                raise InvalidArgumentError("adapter", "only MERGED jobs send an adapter beside the manifest")
            return manifest
        if adapter is None:
            raise InvalidArgumentError("adapter", "MERGED jobs must send the adapter too (kept for late joiners)")
        _check_payload(adapter, "adapter")
        if adapter.mode != ADAPTER:
            raise InvalidArgumentError("adapter.mode", "must be ADAPTER")
        if (adapter.job_id, adapter.version) != (manifest.job_id, manifest.version):
            raise InvalidArgumentError("adapter.version", "adapter must have the manifest's job_id and version")
        if adapter.base_model_fingerprint != manifest.base_model_fingerprint:
            raise InvalidArgumentError("adapter.base_model_fingerprint", "differs from the manifest's")
        job.spec.check(adapter, "adapter")
        return adapter

    def version(self, job_id: str, version: int) -> VersionRecord:
        """A kept version; 0 means the active one."""
        job = self.job(job_id)
        wanted = version or job.active_version
        record = job.versions.get(wanted)
        if record is None:
            what = f"version {wanted}" if wanted else "active version"
            raise NotFoundError(f"job {job_id} has no {what} on record (kept: {sorted(job.versions)})",
                                field="version")
        return record

    def set_durable(self, job_id: str, version: int) -> None:
        self.jobs[job_id].versions[version].durable = True

    def set_active(self, job_id: str, version: int) -> None:
        """The version every replica of its round now serves; what late joiners get from here on."""
        job = self.jobs[job_id]
        if version <= job.active_version:
            raise FailedPreconditionError(f"version {version} is not newer than active {job.active_version}")
        job.active_version = version
        if self.store is not None:
            self.store.save_active(job_id, version)
        self._prune(job)

    def _prune(self, job: JobRecord) -> None:
        keep = sorted(job.versions, reverse=True)[: self.keep_versions]
        protect = {*keep, job.active_version}
        for v in [v for v in job.versions if v not in protect]:
            del job.versions[v]
        if self.store is not None:
            self.store.prune(job.job_id, self.keep_versions, protect)
