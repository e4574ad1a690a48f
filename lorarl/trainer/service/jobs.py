"""Training jobs held by one trainer process: an engine, a trajectory buffer and a lock each.

Plain Python (no gRPC): the servicer translates messages and calls these methods; errors are
lorarl.common.errors exceptions that the server maps to statuses. Engine work is CPU/GPU bound
and runs on a worker thread, one operation per job at a time, so the event loop keeps answering
health checks and other jobs' RPCs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lorarl.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from lorarl.common.gc_heap import freeze_long_lived
from lorarl.common.malloc_arenas import limit_malloc_arenas
from lorarl.common.validation import check_id
from lorarl.contract import versions
from lorarl.contract.errors import SpecError
from lorarl.contract.peft import read_peft_config
from lorarl.trainer.engines.api import AdamStep, Metrics, TrainEngine, TrainingSpec, TrajectoryRecord
from lorarl.trainer.engines.factory import create_engine
from lorarl.trainer.service import fit
from lorarl.trainer.service.fair_share import FairShare
from lorarl.trainer.service.validation import (
    BufferFullError,
    FingerprintRule,
    InvalidTrajectory,
    RouteRule,
    TrajectoryBuffer,
    validate_trajectory,
)

logger = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> None:
    """Adds ``nice`` to the calling thread only (Linux keeps niceness per thread); elsewhere a no-op."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError):
        logger.warning("could not lower the priority of the engine threads", exc_info=True)

T = TypeVar("T")
EngineFactory = Callable[..., TrainEngine]  # (spec) or, the default, (spec, bases)


@dataclass
class Job:
    job_id: str
    spec: TrainingSpec
    engine: TrainEngine
    buffer: TrajectoryBuffer
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: The next publish registers with weight sync again and learns its latest version: a new or
    #: rewound job (restarted trainer, loaded checkpoint) must not reuse a number weight sync holds.
    sync_unchecked: bool = True
    trained_tokens: float = 0.0  # completion tokens of its training passes (Prometheus: job_metrics.py)
    trained_passes: int = 0
    trained_seconds: float = 0.0  # those passes in the engine thread (not queued for it)
    #: The last pass's rollout-vs-trainer monitor (lorarl.trainer.rl.correction): KL k3, masked token fraction.
    rollout_kl_k3: float = 0.0
    rollout_masked_token_fraction: float = 0.0
    #: The turns of the jobs on its base (JobManager.share_of): its own turns and waits are counted there.
    turns: FairShare | None = None
    #: Tokens of its calls accepted and not yet answered (trainer.max_job_tokens_in_flight).
    tokens_in_flight: int = 0
    #: Whose turns these are at a shared base: its tenant's ("tenant:<name>", one share for all the tenant's
    #: jobs) when a tenant's key created it, else None (its own).
    account: str | None = None

    def count(self, metrics: Metrics, seconds: float) -> Metrics:
        self.trained_tokens += float(metrics.get("tokens", 0.0))
        self.trained_passes += 1
        self.trained_seconds += seconds
        self.rollout_kl_k3 = float(metrics.get("rollout_kl_k3", self.rollout_kl_k3))
        self.rollout_masked_token_fraction = float(metrics.get("rollout_masked_token_fraction",
                                                               self.rollout_masked_token_fraction))
        return metrics

    @property
    def tokens_per_second(self) -> float:
        return self.trained_tokens / self.trained_seconds if self.trained_seconds > 0 else 0.0


def check_job_id(job_id: str) -> None:
    check_id("job_id", job_id)


def resolve_under(path: str, roots: Sequence[Path], field_name: str, default: Path) -> Path:
    """A client-given path, confined to the configured roots (relative paths resolve under the first)."""
    if not path:
        return default.resolve()
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    candidate = candidate.resolve()
    for root in roots:
        root = root.resolve()
        if candidate == root or root in candidate.parents:
            return candidate
    raise InvalidArgumentError(field_name, f"{path!r} is outside the allowed directories {[str(r) for r in roots]}")


class JobManager:
    """Creates, runs and forgets training jobs."""

    def __init__(self, *, max_jobs: int = 4, model_roots: Sequence[str] = (),
                 engine_factory: EngineFactory = create_engine, compute_nice: int = 0,
                 free_bytes: fit.FreeBytes | None = None, max_job_tokens_in_flight: int = 0,
                 shared_base: str = "") -> None:
        """``free_bytes``: bytes free on a device now (default: the device's own count, the host's on CPU);
        ``shared_base``: the co-located job's shared base (trainer.shared_base)."""
        self.max_jobs = max_jobs
        self.max_job_tokens_in_flight = max_job_tokens_in_flight
        self.model_roots = [Path(r) for r in model_roots]
        # Torch-engine jobs on one base share its one resident copy (lorarl.trainer.engines.torch.shared_base).
        from lorarl.trainer.engines.torch.shared_base import BaseRegistry

        self.bases = BaseRegistry(shared_base)
        self.free_bytes = free_bytes or fit.free_on
        self.engine_factory = functools.partial(create_engine, bases=self.bases) \
            if engine_factory is create_engine else engine_factory
        self._jobs: dict[str, Job] = {}
        self._shares: dict[Any, FairShare] = {}  # per resident base (or job): its jobs' turns
        self._creating: set[str] = set()
        self._arenas_capped = False
        self._compute_nice = compute_nice
        self._threads: dict[str, ThreadPoolExecutor] = {}

    async def _in_engine_thread(self, job_id: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the job's own engine thread (at `compute_nice` when asked). One thread per job, not a
        pool: glibc keeps what a thread frees in that thread's arena, so a job whose calls wandered over a pool's
        threads held a step-sized high-water mark in each (the Qwen3-0.6B-shaped async job: 6.1 GiB peak against
        5.0 GiB in sync; bench/service_memory.py)."""
        thread = self._threads.get(job_id)
        if thread is None:
            nice = self._compute_nice
            thread = self._threads[job_id] = ThreadPoolExecutor(
                1, f"engine-{job_id}", lower_thread_priority if nice else None, (nice,) if nice else ())
        return await asyncio.get_running_loop().run_in_executor(thread, functools.partial(fn, *args))

    def _release_thread(self, job_id: str) -> None:
        thread = self._threads.pop(job_id, None)
        if thread is not None:
            thread.shutdown(wait=False)

    # ------------------------------------------------------------ lifecycle

    def get(self, job_id: str) -> Job:
        check_job_id(job_id)
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r}; create it with CreateJob first")
        return job

    def list(self) -> list[Job]:
        return [self._jobs[k] for k in sorted(self._jobs)]

    def _check_model_path(self, spec: TrainingSpec) -> None:
        path = Path(spec.base_model_path)
        if self.model_roots:
            resolve_under(spec.base_model_path, self.model_roots, "config.base_model_path", path)
        if not (path / "config.json").is_file():
            raise InvalidArgumentError("config.base_model_path",
                                       f"{spec.base_model_path!r} is not a Hugging Face model directory "
                                       "(no config.json)")

    def _check_init_adapter(self, spec: TrainingSpec) -> None:
        """A warm start's adapter: under the model roots (when set), a PEFT LoRA directory the job's LoRA
        section matches (lorarl.contract.lora.LoraSpec.warm_start_problems)."""
        if not spec.init_adapter_path:
            return
        if self.model_roots:
            if not Path(spec.init_adapter_path).is_absolute():
                raise InvalidArgumentError("config.init_adapter_path", "must be an absolute path on the trainer")
            resolve_under(spec.init_adapter_path, self.model_roots, "config.init_adapter_path",
                          Path(spec.init_adapter_path))
        try:
            config = read_peft_config(spec.init_adapter_path)
        except ValueError as e:
            raise InvalidArgumentError("config.init_adapter_path", str(e)) from None
        problems = spec.lora.warm_start_problems(config)
        if problems:
            raise InvalidArgumentError("config.init_adapter_path", "; ".join(problems))

    def _base_resident(self, spec: TrainingSpec) -> bool:
        from lorarl.trainer.engines.torch.shared_base import BaseKey

        return spec.engine == "torch" and not spec.full_finetune and self.bases.get(BaseKey.of(spec)) is not None

    def _check_shareable(self, spec: TrainingSpec) -> None:
        """The Megatron engine keeps a base of its own per job: a second job on a base one already holds is
        refused rather than loading it again (the torch engine shares it)."""
        if spec.engine != "megatron":
            return
        for job in self._jobs.values():
            if job.spec.engine == "megatron" and Path(job.spec.base_model_path).resolve() == \
                    Path(spec.base_model_path).resolve():
                raise FailedPreconditionError(
                    f"job {job.job_id!r} already trains {spec.base_model_path} on the megatron engine, which does "
                    "not share a base between jobs; use engine 'torch' (jobs on one base share it) or delete it")

    async def create(self, job_id: str, spec: TrainingSpec, attach: bool = False,
                     tenant: str | None = None) -> tuple[Job, bool]:
        """A new job, or with ``attach`` the existing one of the same configuration; True when attached.
        ``tenant``: the tenant whose key created it (its turns at a shared base are charged to the tenant)."""
        check_job_id(job_id)
        if job_id in self._creating:
            raise UnavailableError(f"job {job_id!r} is being created by another call; retry in a few seconds")
        existing = self._jobs.get(job_id)
        if existing is not None:
            if not attach:
                raise AlreadyExistsError(f"job {job_id!r} already exists; delete it or pick another id")
            if existing.spec != spec:
                raise AlreadyExistsError(f"job {job_id!r} already exists with a different configuration; delete "
                                         "it (DeleteJob) or pick another job id")
            return existing, True
        if len(self._jobs) + len(self._creating) >= self.max_jobs:
            raise ResourceExhaustedError(f"this trainer holds at most {self.max_jobs} jobs; delete one first")
        self._check_model_path(spec)
        self._check_init_adapter(spec)
        self._check_shareable(spec)
        self._creating.add(job_id)
        if self._jobs and not self._arenas_capped:
            # Several jobs take turns on the engine threads: from the second job on, threads that start
            # allocating share one glibc arena instead of holding one activation-sized high-water mark each.
            # Not earlier: for a trainer's only job the cap costs ~6% step time on CPU (lock contention).
            self._arenas_capped = limit_malloc_arenas()
        try:
            if spec.engine == "torch" and not self._base_resident(spec):  # Megatron shards its own: not here
                await self._in_engine_thread(job_id, fit.check_base_fits, spec.base_model_path, spec.dtype,
                                             spec.device, self.free_bytes, spec.layer_devices)
            try:
                engine = await self._in_engine_thread(job_id, self.engine_factory, spec)
            except (ValueError, OSError) as e:
                raise InvalidArgumentError("config", f"cannot build the job's engine: {e}") from None
            try:
                _, base_jobs, adapter_bytes = engine.memory()
                fit.check_job_fits(adapter_bytes, base_jobs, spec.device, self.free_bytes)
            except ResourceExhaustedError:
                await self._in_engine_thread(job_id, engine.close)
                raise
            try:
                await self._in_engine_thread(job_id, engine.warm_up)
            except Exception:  # the job still trains; its first step just pays the set-up itself
                logger.warning("job %s: engine warm-up failed", job_id, exc_info=True)
            routes = RouteRule(getattr(engine, "route_shape", None), ignore=spec.routing_replay == "off")
            if spec.routing_replay == "on" and routes.shape is None:
                await self._in_engine_thread(job_id, engine.close)
                raise FailedPreconditionError(f"routing_replay 'on': {spec.base_model_path} has no MoE router the "
                                              f"{spec.engine} engine replays (use 'auto' or 'off')")
            freeze_long_lived()  # the model lives as long as the job: keep full collections off it
            job = Job(job_id, spec, engine, TrajectoryBuffer(engine.vocab_size, spec.limits, spec.loss, routes,
                                                             FingerprintRule(action=spec.fingerprint_check)))
            job.turns = self.share_of(job)
            job.account = f"tenant:{tenant}" if tenant else None
            self._jobs[job_id] = job
            logger.info("job %s: created on base %s, resident once for %d job(s); its own adapter %.1f MiB",
                        job_id, spec.base_model_path, base_jobs, adapter_bytes / 2**20)
            return job, False
        finally:
            self._creating.discard(job_id)
            if job_id not in self._jobs:  # refused or failed: its thread goes with it
                self._release_thread(job_id)

    async def delete(self, job_id: str) -> None:
        job = self.get(job_id)
        async with self._turn(job):
            self._jobs.pop(job_id, None)
            await self._in_engine_thread(job_id, job.engine.close)  # a multi-rank engine is freed on every rank
        self._release_thread(job_id)
        (job.turns or self.share_of(job)).forget(job_id)

    # ------------------------------------------------------------ data

    def push(self, job_id: str, records: Sequence[TrajectoryRecord]
             ) -> list[InvalidTrajectory | BufferFullError | None]:
        job = self.get(job_id)
        return job.buffer.push_many(records, job.engine.version)

    def _validated(self, job: Job, records: Sequence[TrajectoryRecord], field_name: str, loss=None
                   ) -> list[TrajectoryRecord]:
        for i, rec in enumerate(records):
            try:
                validate_trajectory(rec, job.engine.vocab_size, job.engine.version, job.spec.limits,
                                    loss or job.spec.loss, job.buffer.routes, job.buffer.fingerprints)
            except InvalidTrajectory as e:
                raise InvalidArgumentError(f"{field_name}[{i}].{e.field}", e.message) from None
        return list(records)

    # ------------------------------------------------------------ engine work

    def share_of(self, job: Job) -> FairShare:
        """The turns of the jobs on ``job``'s base: torch-engine jobs on one base (shared_base.BaseKey) share
        it and its turns; any other job has a base, and turns, of its own. Looked up once, at creation
        (``job.turns``)."""
        from lorarl.trainer.engines.torch.shared_base import BaseKey

        spec = job.spec
        key = BaseKey.of(spec) if spec.engine == "torch" and not spec.full_finetune else job.job_id
        return self._shares.setdefault(key, FairShare())

    @contextlib.asynccontextmanager
    async def _turn(self, job: Job) -> AsyncIterator[None]:
        """The job's own lock (its calls one at a time), then its turn at its base (weighted fair share).
        On the way out the lock goes first and the turn one loop iteration later: the job's next call, woken
        by the lock, is then already waiting for the base, so the share weighs every job that has work."""
        await job.lock.acquire()
        turn = (job.turns or self.share_of(job)).turn(job.job_id, job.spec.share, job.account)
        try:
            await turn.__aenter__()
        except BaseException:
            job.lock.release()
            raise
        try:
            yield
        finally:
            job.lock.release()
            try:
                await asyncio.sleep(0)
            finally:
                await turn.__aexit__(None, None, None)

    @contextlib.contextmanager
    def _holding(self, job: Job, records: Sequence[TrajectoryRecord]) -> Iterator[None]:
        """The call's tokens counted on its job while it waits and runs; RESOURCE_EXHAUSTED first when they would
        take the job past trainer.max_job_tokens_in_flight (a call past it alone: INVALID_ARGUMENT, to split)."""
        tokens = sum(r.num_tokens for r in records)
        quota = self.max_job_tokens_in_flight
        if quota and tokens > quota:
            raise InvalidArgumentError("trajectories", f"this call holds {tokens} tokens; a job may have at most "
                                       f"{quota} in flight on this trainer (trainer.max_job_tokens_in_flight): "
                                       "split it")
        if quota and job.tokens_in_flight + tokens > quota:
            raise ResourceExhaustedError(
                f"job {job.job_id!r} has {job.tokens_in_flight} tokens in calls not yet answered and this call adds "
                f"{tokens}; each job may have {quota} (trainer.max_job_tokens_in_flight): retry once its calls end")
        job.tokens_in_flight += tokens
        try:
            yield
        finally:
            job.tokens_in_flight -= tokens

    async def _run(self, job: Job, fn: Callable[..., T], *args: Any) -> T:
        async with self._turn(job):
            return await self._in_engine_thread(job.job_id, fn, *args)

    async def _trained(self, job: Job, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the engine thread, its seconds there (not in the executor's queue) counted on the job
        with the tokens of the metrics it returns (alone, or first of a tuple)."""

        def timed() -> tuple[Any, float]:
            started = time.perf_counter()
            out = fn(*args)
            return out, time.perf_counter() - started

        out, seconds = await self._in_engine_thread(job.job_id, timed)
        job.count(out[0] if isinstance(out, tuple) else out, seconds)
        return out

    async def train_step(self, job_id: str, max_trajectories: int, inline: Sequence[TrajectoryRecord]
                         ) -> tuple[Metrics, int, int]:
        """One optimiser step on buffered (+ inline) trajectories; popped ones go back on failure."""
        job = self.get(job_id)
        extra = self._validated(job, inline, "trajectories")
        with self._holding(job, extra):
            async with self._turn(job):
                batch = job.buffer.pop_batch(max_trajectories)
                if not batch and not extra:
                    raise FailedPreconditionError(f"job {job_id!r} has no trajectories to train on; push some first")
                try:
                    metrics = await self._trained(job, job.engine.train_step, batch + extra)
                except BaseException:
                    job.buffer.restore(batch)
                    raise
        return metrics, job.engine.version, job.engine.step

    async def forward_backward(self, job_id: str, records: Sequence[TrajectoryRecord], loss=None, *,
                               forward_only: bool = False, logprobs: bool = False
                               ) -> tuple[Metrics, list[list[float]]]:
        """Metrics, and each record's logprobs when asked (``forward_only``: no gradient kept)."""
        job = self.get(job_id)
        batch = self._validated(job, records, "trajectories", loss)
        if not batch:
            raise InvalidArgumentError("trajectories", "is empty")
        with self._holding(job, batch):
            async with self._turn(job):
                if not (forward_only or logprobs):
                    return await self._trained(job, job.engine.forward_backward, batch, loss), []
                try:
                    if forward_only:  # no training pass: not counted
                        return await self._in_engine_thread(job_id, job.engine.forward_with_logprobs, batch, loss,
                                                            True)
                    return await self._trained(job, job.engine.forward_with_logprobs, batch, loss, False)
                except NotImplementedError as e:
                    raise FailedPreconditionError(str(e)) from None

    async def optim_step(self, job_id: str, lr: float | None, adam: AdamStep | None = None
                         ) -> tuple[Metrics, int, int]:
        job = self.get(job_id)
        if adam is not None:
            try:
                adam.applied_to(job.spec.optimizer)  # refused before the engine thread, naming the field
            except SpecError as e:
                raise InvalidArgumentError(e.field, f"{e.field} {e.problem}") from None
        try:
            metrics = await self._run(job, job.engine.optim_step, lr, adam)
        except RuntimeError as e:
            raise FailedPreconditionError(str(e)) from None
        return metrics, job.engine.version, job.engine.step

    async def compute_logprobs(self, job_id: str, records: Sequence[TrajectoryRecord], reference: bool
                               ) -> list[list[float]]:
        job = self.get(job_id)
        vocab = job.engine.vocab_size
        for i, rec in enumerate(records):
            for name in ("prompt_token_ids", "completion_token_ids"):
                ids = getattr(rec, name)
                if not ids:
                    raise InvalidArgumentError(f"trajectories[{i}].{name}", "is empty")
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise InvalidArgumentError(f"trajectories[{i}].{name}", f"token id {bad} outside [0, {vocab})")
            if rec.num_tokens > job.spec.limits.max_sequence_tokens:
                raise InvalidArgumentError(f"trajectories[{i}]", "longer than max_sequence_tokens")
        # Only the token ids matter here: whatever else a trajectory carries (behaviour logprobs, versions,
        # reward) is not read, so it cannot be malformed either.
        ids_only = [TrajectoryRecord(r.prompt_token_ids, r.completion_token_ids, [0.0] * len(r.completion_token_ids),
                                     [0] * len(r.completion_token_ids), 0.0) for r in records]
        with self._holding(job, ids_only):
            return await self._run(job, job.engine.compute_logprobs, ids_only, reference)

    async def save_checkpoint(self, job_id: str, path: Path, data_cursor: Any = None):
        job = self.get(job_id)
        return await self._run(job, job.engine.save_checkpoint, path, data_cursor)

    async def load_checkpoint(self, job_id: str, path: Path):
        job = self.get(job_id)
        if not path.exists():
            raise NotFoundError(f"no checkpoint at {str(path)!r}")
        from lorarl.trainer.engines.checkpoint import CheckpointError

        try:
            info = await self._run(job, job.engine.load_checkpoint, path)
            job.sync_unchecked = True
            return info
        except CheckpointError as e:
            raise FailedPreconditionError(f"checkpoint {str(path)!r} refused: {e}") from None

    async def export(self, job_id: str, merged: bool, path: Path) -> Path:
        job = self.get(job_id)
        fn = job.engine.export_merged if merged else job.engine.export_adapter
        return await self._run(job, fn, path)

    # ------------------------------------------------------------ weight sync

    async def publish(self, job_id: str, publisher: Any, mode: int, wait: bool, timeout_s: float,
                      skip_unpublished: bool = False) -> PublishOutcome:
        """Publishes the job's current version through weight sync (a WeightPublisher).

        The engine is locked while the payload is packed and sent, so training cannot change it
        underneath; waiting for the replicas to activate happens outside the lock. ``skip_unpublished``: the
        job registers again with weight sync from the version before this one (an idempotent registration that
        only moves its latest version up), so versions trained since the last publish are skipped, not a gap.
        """
        import grpc

        from lorarl.weightsync.client.publisher import PublishError
        from lorarl.weightsync.wire.catalog import catalog_from_tensors

        job = self.get(job_id)
        engine = job.engine
        try:
            async with job.lock:
                if not versions.publishable(engine.version):
                    raise FailedPreconditionError(
                        f"job {job_id!r} is at version 0 (the base model every replica already serves); "
                        "train a step before publishing")
                if job_id not in publisher.jobs or job.sync_unchecked or skip_unpublished:
                    catalog = await self._in_engine_thread(
                        job_id, lambda: catalog_from_tensors(engine.iter_base_tensors()))
                    registration = await publisher.register_job(
                        job_id, base_model_fingerprint=engine.base_model_fingerprint, lora=job.spec.lora.to_proto(),
                        catalog=catalog, mode=mode, start_version=versions.previous(engine.version))
                    if registration.latest_version >= engine.version:
                        # Weight sync holds this number (and maybe more) from before a restart or rewind:
                        # these weights continue above them.
                        logger.info("job %s: version %d continues as %d, above weight sync's latest",
                                    job_id, engine.version, versions.next_version(registration.latest_version),
                                    extra={"job_id": job_id})
                        await self._in_engine_thread(job_id, engine.renumber,
                                                     versions.next_version(registration.latest_version))
                    job.sync_unchecked = False
                version = engine.version
                result = await publisher.publish(
                    job_id, version, wait=False,
                    adapter=lambda: [(n, t.detach().clone()) for n, t in engine.iter_adapter_tensors()],
                    merged=engine.iter_merged_tensors)
                job.buffer.fingerprints.record(version, result.fingerprints)  # what its trajectories must name
            registration = publisher.jobs[job_id]
            outcome = PublishOutcome(version=version, mode=registration.mode, mode_reason=registration.reason,
                                     duplicate=result.duplicate, payload_bytes=result.payload_bytes,
                                     transport=result.transport, send_error=result.send_error)
            if wait:
                activation = await publisher.await_activation(job_id, version, timeout_s)
                outcome.activated = activation.ok
                outcome.error = activation.error or ("" if activation.ok else activation.outcome_name)
                outcome.failed_replicas = list(activation.failed_replicas)
            return outcome
        except PublishError as e:
            if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise UnavailableError(f"weight-sync service unreachable: {e}") from None
            raise FailedPreconditionError(f"weight sync refused version: {e}") from None
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise UnavailableError(f"weight-sync service unreachable: {e.details()}") from None
            raise FailedPreconditionError(f"weight sync answered {e.code().name}: {e.details()}") from None


@dataclass
class PublishOutcome:
    """What PublishWeights reports back."""

    version: int
    mode: int
    mode_reason: str
    duplicate: bool
    payload_bytes: int
    transport: str
    send_error: str = ""
    activated: bool = False
    error: str = ""
    failed_replicas: list[str] = field(default_factory=list)
