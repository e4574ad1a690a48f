"""A lorarl job run the way `lorarl run` runs it, with the clocks the benchmarks need.

The services start on loopback exactly as in `lorarl run` (lorarl.client.launch.local.LocalStack, same service
sections, one OpenMP thread each); the job goes through the same RLLoop. On top, the benchmark
needs what `lorarl run` does not report: start-up and loop time apart, training time with the loop's
own held-out evaluations and the adapter exports taken out (so a curve of held-out accuracy
against training seconds can be drawn), and a PEFT adapter every K steps for an outside evaluator.
Held-out accuracy for a list of PEFT adapters comes from :func:`evaluate_adapters`, the lorarl
eval path (a rollout service, greedy decoding, the job's reward), so any trainer's adapters are
scored the same way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorarl.client.job.config import JobFileConfig
from lorarl.client.rl.loop import LoopState, RLLoop
from lorarl.common.config import to_dict

if TYPE_CHECKING:
    from lorarl.client.launch.local import LocalStack


@dataclass
class JobTiming:
    """What one lorarl job measured."""

    mode: str
    startup_s: float = 0.0  # three services up and the job created
    loop_s: float = 0.0  # RLLoop.run: evaluations, steps and exports
    eval_s: float = 0.0  # the loop's held-out evaluations (before and after, plus eval_every)
    export_s: float = 0.0  # trainer.Export of the adapters for the outside evaluator
    train_s_at_step: dict[int, float] = field(default_factory=dict)  # step -> training seconds at its end
    accuracy_at_step: dict[int, float] = field(default_factory=dict)  # the loop's own evaluations
    adapters: dict[int, str] = field(default_factory=dict)  # step -> PEFT adapter directory
    steps: list[dict[str, float]] = field(default_factory=list)  # per-step metrics rows

    @property
    def train_s(self) -> float:
        """Loop time without evaluations and exports."""
        return self.loop_s - self.eval_s - self.export_s

    @property
    def final_accuracy(self) -> float:
        return self.accuracy_at_step[max(self.accuracy_at_step)]

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "startup_s": self.startup_s, "loop_s": self.loop_s, "eval_s": self.eval_s,
                "export_s": self.export_s, "train_s": self.train_s, "train_s_at_step": self.train_s_at_step,
                "accuracy_at_step": self.accuracy_at_step, "adapters": self.adapters}


class TimedLoop(RLLoop):
    """RLLoop that also keeps the seconds its held-out evaluations took."""

    eval_s = 0.0

    async def evaluate(self) -> dict[str, float]:
        started = time.perf_counter()
        try:
            return await super().evaluate()
        finally:
            self.eval_s += time.perf_counter() - started


def run_job(cfg: JobFileConfig, out: Path, export_every: int = 0, progress: bool = False,
            before_stop: Callable[[LocalStack], None] | None = None) -> JobTiming:
    """Starts the services, runs the job once from scratch, stops the services (``before_stop`` sees
    them still running, e.g. to read a process's peak memory)."""
    from lorarl.client.launch.services import local_stack

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    timing = JobTiming(mode=cfg.loop.mode)
    started = time.perf_counter()
    with local_stack(cfg, out) as stack:
        asyncio.run(_drive(cfg, stack.address("trainer"), stack.address("rollout"), stack.address("weightsync"),
                           stack.token, out, export_every, timing, progress, started))
        if before_stop is not None:
            before_stop(stack)
    return timing


async def _drive(cfg: JobFileConfig, trainer_address: str, rollout_address: str, weightsync_address: str,
                 token: str, out: Path, export_every: int, timing: JobTiming, progress: bool, started: float) -> None:
    from lorarl.client.job.datasets import load_examples
    from lorarl.client.job.rewards import load_reward
    from lorarl.client.rl.loop import job_config_proto
    from lorarl.client.rl.run_log import RunLog
    from lorarl.common.channel import aio_channel
    from lorarl.v1 import common_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weightsync_pb2_grpc

    reward = load_reward(cfg.data.reward)
    train = load_examples(cfg.data.source, "train", cfg.data.train_path)
    test = load_examples(cfg.data.source, "test", cfg.data.test_path)
    log = RunLog(out, total_steps=cfg.loop.steps, tensorboard=False, progress=progress)
    async with aio_channel(trainer_address, token=token) as tch, aio_channel(rollout_address, token=token) as rch, \
            aio_channel(weightsync_address, token=token) as wch:
        trainer = trainer_pb2_grpc.TrainerServiceStub(tch)
        rollout = rollout_pb2_grpc.RolloutServiceStub(rch)
        weightsync = weightsync_pb2_grpc.WeightSyncServiceStub(wch)
        model_path = str(Path(cfg.model.path).resolve())
        await trainer.CreateJob(trainer_pb2.CreateJobRequest(job_id=cfg.job_id,
                                                             config=job_config_proto(cfg, model_path)))
        timing.startup_s = time.perf_counter() - started
        loop: TimedLoop | None = None

        def train_seconds() -> float:
            assert loop is not None
            return time.perf_counter() - loop.started - loop.eval_s - timing.export_s

        def on_metrics(row: dict[str, float]) -> None:
            log(row)
            step = int(row["step"])
            if "eval/accuracy" in row:
                timing.accuracy_at_step[step] = row["eval/accuracy"]
            else:
                timing.train_s_at_step[step] = train_seconds()
                timing.steps.append(row)

        async def export(state: LoopState) -> None:
            if state.step in timing.adapters:
                return
            t0 = time.perf_counter()
            response = await trainer.Export(trainer_pb2.ExportRequest(
                job_id=cfg.job_id, mode=common_pb2.SYNC_MODE_ADAPTER, path=f"{cfg.job_id}/step-{state.step:06d}"))
            timing.adapters[state.step] = response.path
            timing.export_s += time.perf_counter() - t0

        if export_every:
            cfg.loop.checkpoint_every = export_every
        loop = TimedLoop(cfg, trainer, rollout, reward, train, test, on_metrics,
                         on_checkpoint=export if export_every else None, weightsync=weightsync)
        try:
            await loop.run()
        finally:
            timing.loop_s = time.perf_counter() - loop.started
            timing.eval_s = loop.eval_s
            log.close()


def evaluate_adapters(cfg: JobFileConfig, out: Path, adapters: list[str | None]) -> list[float]:
    """Held-out greedy accuracy of each PEFT adapter directory (None: the base model), through one
    rollout service started for the purpose: the same evaluator for every trainer's adapters."""
    from lorarl.client.commands.evaluate import evaluate, read_adapter
    from lorarl.client.launch.local import LocalStack
    from lorarl.client.launch.services import stack_sections

    sections = stack_sections(cfg, out)
    with LocalStack(out / "eval-services", {"rollout": sections["rollout"]}, services=("rollout",)) as stack:
        results = asyncio.run(evaluate(cfg, stack.address("rollout"), stack.token,
                                       [None if a is None else read_adapter(Path(a)) for a in adapters]))
    return [r["eval/accuracy"] for r in results]
