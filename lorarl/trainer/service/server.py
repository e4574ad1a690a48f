"""TrainerService over gRPC: a thin servicer over lorarl.trainer.service.jobs.JobManager.

Methods translate protobuf messages to plain objects (lorarl.trainer.service.convert), call the manager
and translate back; errors raised as lorarl.common.errors exceptions become statuses in the
bootstrap's interceptor. torch and transformers load lazily with the first job, so
`lorarl serve trainer` starts fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import grpc

from lorarl.common.auth import server_token
from lorarl.common.channel import ClientTls, peer_tls
from lorarl.common.config import ConfigError
from lorarl.common.errors import FailedPreconditionError, InvalidArgumentError
from lorarl.common.log import configure_logging
from lorarl.common.metrics import RpcMetrics
from lorarl.common.server import Register, RunningServer, StartupError, serve
from lorarl.common.validation import check_path
from lorarl.contract.errors import SpecError
from lorarl.contract.sharing import EngineLora, sharing_refusal
from lorarl.contract.training import AdamStep
from lorarl.trainer.service import convert
from lorarl.trainer.service.config import TrainerServiceConfig, TrainerSettings
from lorarl.trainer.service.job_metrics import JobsCollector
from lorarl.trainer.service.jobs import Job, JobManager, resolve_under
from lorarl.trainer.service.retention import prune_step_checkpoints
from lorarl.trainer.service.tenancy import Tenants, check_own_paths
from lorarl.trainer.service.validation import BufferFullError
from lorarl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

NAME = "trainer"
SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
CONFIG_TYPE = TrainerServiceConfig

logger = logging.getLogger(__name__)


def job_status(job: Job) -> trainer_pb2.JobStatus:
    engine = job.engine
    base_bytes, base_jobs, job_bytes = engine.memory()
    return trainer_pb2.JobStatus(
        job_id=job.job_id, config=convert.job_config(job.spec), version=engine.version, step=engine.step,
        buffered_trajectories=len(job.buffer), base_model_fingerprint=engine.base_model_fingerprint,
        trainable_parameters=engine.trainable_parameters, total_parameters=engine.total_parameters,
        base_bytes=base_bytes, base_jobs=base_jobs, job_bytes=job_bytes, trained_tokens=job.trained_tokens,
        tokens_per_second=job.tokens_per_second,
        base_turns=job.turns.turns.get(job.job_id, 0) if job.turns else 0,
        base_wait_seconds=job.turns.waited.get(job.job_id, 0.0) if job.turns else 0.0,
    )


def item_status(index: int, error: Exception | None) -> common_pb2.ItemStatus:
    if error is None:
        return common_pb2.ItemStatus(index=index, code=grpc.StatusCode.OK.value[0])
    if isinstance(error, BufferFullError):
        return common_pb2.ItemStatus(index=index, code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                     message=str(error))
    field = getattr(error, "field", "")
    return common_pb2.ItemStatus(index=index, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                 message=str(error), field=field)


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """TrainerService RPCs, each delegating to a JobManager."""

    def __init__(self, settings: TrainerSettings, jobs: JobManager | None = None, token: str | None = None,
                 peer_tls: ClientTls | None = None) -> None:
        self.settings, self.peer_tls = settings, peer_tls
        self.jobs = jobs or JobManager(max_jobs=settings.max_jobs, model_roots=settings.model_roots,
                                       compute_nice=settings.compute_nice,
                                       max_job_tokens_in_flight=settings.max_job_tokens_in_flight,
                                       shared_base=settings.shared_base)
        self.token = token
        self.colocation_id = ""
        if settings.shared_base:  # checked at start: a launcher's handle that does not open fails here, by name
            from lorarl.contract.base_segment import open_segment
            from lorarl.platform.shared_memory import colocation_id

            open_segment(settings.shared_base).close()
            self.colocation_id = colocation_id(settings.shared_base)
        self.tenants = Tenants.from_settings(settings.tenants)
        if self.tenants.tenants and not settings.model_roots:
            raise ConfigError("trainer.model_roots", "is required with trainer.tenants: a tenant's job may read "
                                                     "model and adapter directories only under these roots")
        self._publisher = None

    def publisher(self):
        """The weight-sync client, made on first use (the same bearer token as this server's)."""
        if self._publisher is None:
            if not self.settings.weightsync_address:
                raise FailedPreconditionError("trainer.weightsync_address is not set; this trainer cannot publish")
            from lorarl.weightsync.client.publisher import WeightPublisher

            self._publisher = WeightPublisher(
                self.settings.weightsync_address, token=self.token, tls=self.peer_tls,
                host=self.settings.sender_host or None,
                collective=self.settings.collective, bucket_bytes=self.settings.bucket_mb << 20,
                device=self.settings.device, colocation_id=self.colocation_id)
        return self._publisher

    async def close(self) -> None:
        if self._publisher is not None:
            await self._publisher.close()

    def _path(self, path: str, root: str, field: str, default_name: str, job_id: str = "",
              context: grpc.aio.ServicerContext | None = None) -> Path:
        """A client path under ``root``; a tenant's (per-job key) stays inside its job's folder there."""
        check_path(field, path)
        base = Path(root)
        if context is not None and self.tenants.of(context.invocation_metadata()) is not None:
            base = base / job_id
            default_name = default_name.removeprefix(f"{job_id}/")
        return resolve_under(path, [base], field, base / default_name)

    def _scoped(self, context: grpc.aio.ServicerContext, job_id: str) -> None:
        """PERMISSION_DENIED when the caller's per-job key does not cover ``job_id`` (service.tenancy)."""
        self.tenants.check(context.invocation_metadata(), job_id)

    async def _check_shared_rollouts(self, job_id: str, spec) -> None:
        """FAILED_PRECONDITION at creation, not at the first publish, for a job that a rollout several jobs share
        could serve only by writing over its base (lorarl.contract.sharing): the replicas weight sync knows, as
        they subscribed. Weight sync out of reach: not checked here; its registration refuses the same."""
        if not self.settings.weightsync_address:
            return
        try:
            status = await self.publisher().status_now()
        except grpc.aio.AioRpcError as e:
            logger.warning("job %s: weight sync unreachable (%s); the shared-rollout check waits for its "
                           "registration", job_id, e.code().name)
            return
        for replica in status.fleet:
            caps = replica.capabilities
            if caps.shared and (why := sharing_refusal(EngineLora.of(caps), spec.lora.rank,
                                                       merged=spec.full_finetune)):
                raise FailedPreconditionError(f"job {job_id!r} cannot sample from rollout {replica.replica_id}: {why}")

    async def CreateJob(self, request, context):
        self._scoped(context, request.job_id)
        spec = convert.job_spec(request.config, self.settings.device)
        tenant = self.tenants.of(context.invocation_metadata())
        if tenant is not None:
            check_own_paths(tenant, {"config.base_model_path": spec.base_model_path,
                                     "config.init_adapter_path": spec.init_adapter_path},
                            [self.settings.checkpoint_dir, self.settings.export_dir])
        await self._check_shared_rollouts(request.job_id, spec)
        job, attached = await self.jobs.create(request.job_id, spec, attach=request.attach,
                                               tenant=tenant.name if tenant is not None else None)
        if self.settings.weightsync_address:
            self.publisher().connect()  # the first publish should not pay for the import and the handshake
        return trainer_pb2.CreateJobResponse(job=job_status(job), attached=attached)

    async def GetJob(self, request, context):
        self._scoped(context, request.job_id)
        return trainer_pb2.GetJobResponse(job=job_status(self.jobs.get(request.job_id)))

    async def ListJobs(self, request, context):
        visible = set(self.tenants.visible(context.invocation_metadata(), [j.job_id for j in self.jobs.list()]))
        return trainer_pb2.ListJobsResponse(jobs=[job_status(j) for j in self.jobs.list() if j.job_id in visible])

    async def DeleteJob(self, request, context):
        self._scoped(context, request.job_id)
        await self.jobs.delete(request.job_id)
        return trainer_pb2.DeleteJobResponse()

    async def PushTrajectories(self, request_iterator, context) -> AsyncIterator[trainer_pb2.PushTrajectoriesResponse]:
        async for request in request_iterator:
            self._scoped(context, request.job_id)
            records = [convert.trajectory_record(t) for t in request.trajectories]
            errors = self.jobs.push(request.job_id, records)
            statuses = [item_status(i, e) for i, e in enumerate(errors)]
            yield trainer_pb2.PushTrajectoriesResponse(
                statuses=statuses, accepted=sum(e is None for e in errors),
                buffered_trajectories=len(self.jobs.get(request.job_id).buffer))

    async def TrainStep(self, request, context):
        self._scoped(context, request.job_id)
        inline = [convert.trajectory_record(t) for t in request.trajectories]
        metrics, version, step = await self.jobs.train_step(request.job_id, request.max_trajectories, inline)
        return trainer_pb2.TrainStepResponse(version=version, step=step, metrics=convert.step_metrics(metrics))

    async def ForwardBackward(self, request, context):
        self._scoped(context, request.job_id)
        loss = convert.loss_spec(request.loss, "loss") if request.HasField("loss") else None
        records = [convert.trajectory_record(t) for t in request.trajectories]
        metrics, logprobs = await self.jobs.forward_backward(request.job_id, records, loss,
                                                             forward_only=request.forward_only,
                                                             logprobs=request.return_logprobs)
        return trainer_pb2.ForwardBackwardResponse(metrics=convert.step_metrics(metrics),
                                                   logprobs=[trainer_pb2.TokenLogprobs(logprobs=lp) for lp in logprobs])

    async def OptimStep(self, request, context):
        self._scoped(context, request.job_id)
        if not (math.isfinite(request.learning_rate) and request.learning_rate >= 0):
            raise InvalidArgumentError("learning_rate", f"must be a finite number >= 0 (0 keeps the schedule), "
                                                        f"got {request.learning_rate}")
        try:
            adam = AdamStep.from_proto(request)
        except SpecError as e:
            raise InvalidArgumentError(e.field, str(e)) from None
        metrics, version, step = await self.jobs.optim_step(request.job_id, request.learning_rate or None, adam)
        return trainer_pb2.OptimStepResponse(version=version, step=step, metrics=convert.step_metrics(metrics))

    async def ComputeLogprobs(self, request, context):
        self._scoped(context, request.job_id)
        records = [convert.trajectory_record(t) for t in request.trajectories]
        results = await self.jobs.compute_logprobs(request.job_id, records, request.reference)
        return trainer_pb2.ComputeLogprobsResponse(results=[trainer_pb2.TokenLogprobs(logprobs=r) for r in results])

    async def SaveCheckpoint(self, request, context):
        self._scoped(context, request.job_id)
        job = self.jobs.get(request.job_id)
        path = self._path(request.path, self.settings.checkpoint_dir, "path",
                          f"{request.job_id}/step-{job.engine.step:06d}", request.job_id, context)
        info = await self.jobs.save_checkpoint(request.job_id, path)
        removed = prune_step_checkpoints(Path(info.path), request.keep_last) if request.keep_last else []
        return trainer_pb2.SaveCheckpointResponse(path=str(info.path), version=info.version, step=info.step,
                                                  removed=[str(r) for r in removed])

    async def LoadCheckpoint(self, request, context):
        self._scoped(context, request.job_id)
        if not request.path:
            raise InvalidArgumentError("path", "is required")
        path = self._path(request.path, self.settings.checkpoint_dir, "path", "", request.job_id, context)
        info = await self.jobs.load_checkpoint(request.job_id, path)
        return trainer_pb2.LoadCheckpointResponse(version=info.version, step=info.step)

    async def Export(self, request, context):
        self._scoped(context, request.job_id)
        if request.mode not in (common_pb2.SYNC_MODE_ADAPTER, common_pb2.SYNC_MODE_MERGED):
            raise InvalidArgumentError("mode", "must be SYNC_MODE_ADAPTER or SYNC_MODE_MERGED")
        merged = request.mode == common_pb2.SYNC_MODE_MERGED
        job = self.jobs.get(request.job_id)
        kind = "merged" if merged else "adapter"
        path = self._path(request.path, self.settings.export_dir, "path",
                          f"{request.job_id}/{kind}-v{job.engine.version:06d}", request.job_id, context)
        out = await self.jobs.export(request.job_id, merged, path)
        return trainer_pb2.ExportResponse(path=str(out))

    async def PublishWeights(self, request, context):
        self._scoped(context, request.job_id)
        if request.mode not in (common_pb2.SYNC_MODE_UNSPECIFIED, common_pb2.SYNC_MODE_ADAPTER,
                                common_pb2.SYNC_MODE_MERGED, common_pb2.SYNC_MODE_AUTO):
            raise InvalidArgumentError("mode", f"unknown sync mode {request.mode}")
        self.jobs.get(request.job_id)
        started = time.perf_counter()
        outcome = await self.jobs.publish(request.job_id, self.publisher(), request.mode or common_pb2.SYNC_MODE_AUTO,
                                          request.wait_for_activation, float(request.timeout_seconds or 600),
                                          skip_unpublished=request.skip_unpublished)
        return trainer_pb2.PublishWeightsResponse(
            seconds=time.perf_counter() - started, version=outcome.version, mode=outcome.mode,
            mode_reason=outcome.mode_reason, duplicate=outcome.duplicate, activated=outcome.activated,
            error=outcome.error or outcome.send_error, failed_replicas=outcome.failed_replicas,
            payload_bytes=outcome.payload_bytes, transport=outcome.transport)


def registration(servicer: TrainerServicer) -> Register:
    """Adds `servicer` to a server; returns the service names for health and reflection."""

    def register(server: grpc.aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return register


def job_metrics(servicer: TrainerServicer) -> RpcMetrics:
    """The service's RPC metrics with its per-job series beside them (lorarl_trainer_job_*{job_id})."""
    metrics = RpcMetrics()
    metrics.registry.register(JobsCollector(servicer.jobs))
    return metrics


def apply_allocator(threshold_mib: int, environ: Mapping[str, str] = os.environ) -> bool:
    """The trainer's glibc mmap threshold, before anything big is allocated (every rank inherits it: followers
    are started after); the operator's $MALLOC_MMAP_THRESHOLD_ wins. True when set here."""
    if not threshold_mib or "MALLOC_MMAP_THRESHOLD_" in environ:
        return False
    from lorarl.common.malloc_arenas import fix_mmap_threshold

    return fix_mmap_threshold(threshold_mib << 20)


async def serve_forever(config: TrainerServiceConfig) -> None:
    """Runs the trainer service until SIGTERM/SIGINT; with several ranks (trainer.ranks, or torchrun) rank 0
    serves and the others follow it (lorarl.trainer.ranks.follower)."""
    from lorarl.trainer.ranks.launch import RankWorld

    settings, server = config.trainer, config.server
    apply_allocator(settings.malloc_mmap_threshold_mib)
    world = RankWorld.discover(settings.ranks)
    if settings.shared_base and world.world_size > 1:
        raise StartupError(f"trainer.shared_base is one process's base: a trainer of {world.world_size} ranks "
                           "cannot compute on it (placement.colocate takes trainer ranks 1)")
    if world.world_size == 1:
        from lorarl.common.preload import import_in_background

        import_in_background("lorarl.trainer.engines.torch.engine")  # transformers' auto classes: ~5 s, before a job
        servicer = TrainerServicer(settings, token=server_token(server.auth, host=server.host),
                                   peer_tls=peer_tls(server.peer_tls))
        await serve(NAME, server, registration(servicer), on_shutdown=servicer.close,
                    also_tokens=servicer.tenants.tokens, metrics=job_metrics(servicer))
        return
    if ":" in settings.device:
        raise ConfigError("trainer.device", f"{settings.device!r} names one device, but each of the "
                                            f"{world.world_size} ranks takes its own (cuda:LOCAL_RANK): give the "
                                            "type only, e.g. 'cuda'")
    configure_logging(NAME if world.rank == 0 else f"{NAME}-rank{world.rank}", level=server.log_level,
                      fmt=server.log_format)
    if world.rank != 0:
        from lorarl.trainer.ranks.follower import run_follower

        await asyncio.to_thread(run_follower, settings.device, world, settings.rank_timeout_s)
        return
    from lorarl.trainer.ranks.group import RankGroup

    try:
        group = await asyncio.to_thread(RankGroup.start, settings.device, world, settings.rank_timeout_s,
                                        server.log_level, server.log_format)
    except RuntimeError as e:
        raise StartupError(f"trainer ranks did not start: {e}") from None
    jobs = JobManager(max_jobs=settings.max_jobs, model_roots=settings.model_roots, engine_factory=group.create_engine,
                      compute_nice=settings.compute_nice, max_job_tokens_in_flight=settings.max_job_tokens_in_flight)
    servicer = TrainerServicer(settings, jobs=jobs, token=server_token(server.auth, host=server.host),
                               peer_tls=peer_tls(server.peer_tls))

    def started(running: RunningServer) -> None:
        loop = asyncio.get_running_loop()

        def not_serving(reason: str) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the service is stopping anyway
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(running.set_serving(False)))

        group.on_broken(not_serving)

    try:
        await serve(NAME, server, registration(servicer), on_shutdown=servicer.close, on_started=started,
                    also_tokens=servicer.tenants.tokens, metrics=job_metrics(servicer))
    finally:
        await asyncio.to_thread(group.stop)
