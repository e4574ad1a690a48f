"""A job's life on the trainer across faults and re-runs: create or attach, resume points, restore.

The run directory's ``state.json`` names the last resume point: a trainer checkpoint (adapter,
optimiser, RNG) with the loop's step and data cursor. A fresh run saves one at step 0, before any
training, so there is always one to go back to. Restoring loads it on the trainer (a restarted trainer
first gets the job re-created; a live one re-attaches to it) and publishes it again: the trainer then
numbers it above every version weight sync holds, so a number never names two sets of weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.client.job.config import training_spec
from lorarl.client.job.inputs import Teacher
from lorarl.client.rl.loop import LoopState, job_config_proto
from lorarl.client.rl.recovery import ActivationFailedError
from lorarl.contract import versions
from lorarl.contract.enums import SYNC_MODES
from lorarl.v1 import common_pb2, trainer_pb2

logger = logging.getLogger(__name__)

RESUME = "resume"  # the checkpoint name a resume point overwrites (user checkpoints are step-NNNNNN)


@dataclass(frozen=True)
class ResumePoint:
    step: int
    cursor: int
    checkpoint: str  # the trainer's path for it
    version: int = 0  # the trainer's version when it was saved


def read_point(out: Path) -> ResumePoint | None:
    path = out / "state.json"
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return ResumePoint(int(raw["step"]), int(raw["cursor"]), str(raw["checkpoint"]), int(raw.get("version", 0)))


def write_point(out: Path, point: ResumePoint) -> None:
    tmp = out / "state.json.tmp"
    tmp.write_text(json.dumps({"step": point.step, "version": point.version, "cursor": point.cursor,
                               "checkpoint": point.checkpoint}))
    tmp.replace(out / "state.json")


class JobSession:
    """Creates, attaches to, saves and restores one job on one trainer (a NamedStub or raw stub)."""

    def __init__(self, cfg: Any, trainer: Any, out: Path) -> None:
        self.cfg, self.trainer, self.out = cfg, trainer, out

    async def _create(self) -> trainer_pb2.CreateJobResponse:
        model_path = str(Path(self.cfg.model.path).resolve())
        return await self.trainer.CreateJob(trainer_pb2.CreateJobRequest(
            job_id=self.cfg.job_id, config=job_config_proto(self.cfg, model_path), attach=True))

    async def start(self, fresh: bool = False) -> LoopState:
        """The job at its last resume point, or a new one (``fresh``: forget any earlier run's)."""
        if fresh:
            (self.out / "state.json").unlink(missing_ok=True)
        created = await self._create()
        point = read_point(self.out)
        if point is not None:
            state = await self.restore(point)
            print(f"lorarl: resumed from {point.checkpoint} (step {state.step}, version {state.version})", flush=True)
            return state
        if created.attached and created.job.step > 0:
            if not fresh:
                raise RuntimeError(
                    f"job {self.cfg.job_id!r} exists on the trainer at step {created.job.step}, but "
                    f"{self.out / 'state.json'} does not say where it was: point output.dir at that run's "
                    "directory to resume it, or pass --fresh to start the job over")
            await self.trainer.DeleteJob(trainer_pb2.DeleteJobRequest(job_id=self.cfg.job_id))
            await self._create()
        state = LoopState()
        # a warm start: the starting adapter serves before the first batch
        if versions.publishable(created.job.version):
            version = await self.publish()
            state = LoopState(version=version, version_base=version)
        await self.save(state, RESUME)
        return state

    async def publish(self) -> int:
        """Publishes the trainer's current version and waits until the replicas serve it."""
        published = await self.trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(
            job_id=self.cfg.job_id, mode=SYNC_MODES[self.cfg.sync.mode], wait_for_activation=True,
            timeout_seconds=600))
        if not published.activated:
            raise ActivationFailedError(f"version {published.version} was not activated: {published.error} "
                                        f"(failed replicas: {list(published.failed_replicas)})")
        return int(published.version)

    async def serve_teachers(self, teachers: Sequence[Teacher]) -> None:
        """Each distillation teacher as a job of its own on the trainer (its adapter loaded as a warm start, never
        trained: the base is the student's, so it costs the adapter only), published to every rollout replica as
        an adapter and awaited: the replicas then score the student's samples with it. Attaches to the ones a
        previous run (or a restart) left, and publishes them again. A full-model teacher's engine is the
        launcher's (nothing to load here)."""
        model_path = str(Path(self.cfg.model.path).resolve())
        for teacher in teachers:
            if teacher.version_of is not None:
                raise ValueError(f"teacher {teacher.name!r} ({teacher.version_of}) is served once read from weight "
                                 "sync (lorarl.client.rl.teacher_versions)")
            if teacher.own_engine:  # a full model on an engine of its own (lorarl.client.launch.local)
                print(f"lorarl: teacher {teacher.name} serves on its own engine ({teacher.path})", flush=True)
                continue
            job_id = teacher.job_id(self.cfg.job_id)
            spec = dataclasses.replace(training_spec(self.cfg, model_path), lora=teacher.lora,
                                       init_adapter_path=teacher.path)
            await self.trainer.CreateJob(trainer_pb2.CreateJobRequest(job_id=job_id, config=spec.to_proto(),
                                                                      attach=True))
            published = await self.trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(
                job_id=job_id, mode=common_pb2.SYNC_MODE_ADAPTER, wait_for_activation=True, timeout_seconds=600))
            if not published.activated:
                raise ActivationFailedError(f"teacher {teacher.name!r} ({job_id} v{published.version}) was not "
                                            f"served: {published.error} (failed replicas: "
                                            f"{list(published.failed_replicas)})")
            print(f"lorarl: teacher {teacher.name} serves as {job_id} v{published.version} ({teacher.path}, rank "
                  f"{teacher.lora.rank})", flush=True)

    async def recover(self) -> LoopState:
        """After a fault: the job (re-created if the trainer restarted) back at its last resume point."""
        await self._create()
        point = read_point(self.out)
        if point is None:
            raise RuntimeError(f"no resume point in {self.out}: nothing to recover from")
        return await self.restore(point)

    async def restore(self, point: ResumePoint) -> LoopState:
        loaded = await self.trainer.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(
            job_id=self.cfg.job_id, path=point.checkpoint))
        version = int(loaded.version)
        if versions.publishable(version):
            version = await self.publish()
        return LoopState(step=point.step, version=version, cursor=point.cursor,
                         version_base=versions.base_of(version, point.step))

    async def save(self, state: LoopState, name: str) -> None:
        """Checkpoints the job as ``name`` and makes it the resume point."""
        saved = await self.trainer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(
            job_id=self.cfg.job_id, path=f"{self.cfg.job_id}/{name}", keep_last=self.cfg.loop.keep_checkpoints))
        write_point(self.out, ResumePoint(state.step, state.cursor, saved.path, int(saved.version)))
