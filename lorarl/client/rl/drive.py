"""One job driven to its end on running services: create (or resume, or re-attach to) the job, run the loop
against the trainer, the rollout replicas and weight sync, then write the plot and the summary."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from lorarl.common.channel import ClientTls
from lorarl.common.config import ConfigError, to_dict


async def drive(cfg, trainer_address: str, rollout_addresses: str | list[str] | None, token: str | None,
                out: Path, weightsync_address: str | None = None, fresh: bool = False,
                give_up: Callable[[], None] | None = None, tls: ClientTls | None = None,
                openai_urls: Callable[[], list[str]] | None = None) -> int:
    """Creates (or resumes, or re-attaches to) the job, runs the loop, and writes the plot and summary.

    ``rollout_addresses`` empty: the loop learns the rollout replicas from weight sync (lorarl.client.rl.fleet),
    so replicas may join and leave during the run; else that static list (prompts of a replica that fails
    are redone on the others either way)."""
    from lorarl.client.calls import NamedStub
    from lorarl.client.job.inputs import job_examples, job_reward, job_teachers, job_workflow
    from lorarl.client.rl.fleet import weightsync_fleet
    from lorarl.client.rl.loop import RLLoop
    from lorarl.client.rl.preflight import rollout_warnings
    from lorarl.client.rl.recovery import wait_serving
    from lorarl.client.rl.rollout_pool import BUSY_WAIT_S, RolloutPool
    from lorarl.client.rl.run_log import RunLog, wandb_init
    from lorarl.client.rl.session import JobSession
    from lorarl.client.rl.stall import CallTracker, run_watched
    from lorarl.client.rl.teacher_versions import read_version_teachers
    from lorarl.common.channel import aio_channel
    from lorarl.v1 import common_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weightsync_pb2_grpc

    reward, workflow, teachers = job_reward(cfg), job_workflow(cfg), job_teachers(cfg)
    train, test = job_examples(cfg, "train"), job_examples(cfg, "test")
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    if isinstance(rollout_addresses, str):
        rollout_addresses = [rollout_addresses]
    rollout_addresses = list(rollout_addresses or [])
    if not rollout_addresses and not weightsync_address:
        raise ConfigError("--rollout", "name the rollout replicas, or the weight-sync service to learn them from")
    deadline = cfg.loop.call_timeout_s or None  # every call's: a hung service ends in a named error, never a wait
    # a busy replica (its room taken by other jobs' requests) is waited for as long as one call may take
    busy_wait = cfg.loop.call_timeout_s or BUSY_WAIT_S
    tracker = CallTracker()  # the calls in flight, for the stall watchdog
    async with contextlib.AsyncExitStack() as stack:
        channels = {}  # service name -> channel, for the health checks after a fault (same TLS, same token)

        async def channel(service: str, address: str):
            channels[f"{service} at {address}"] = await stack.enter_async_context(
                aio_channel(address, token=token, tls=tls))
            return channels[f"{service} at {address}"]

        replicas: dict[str, NamedStub] = {}  # address -> stub: a replica that leaves and comes back keeps its channel

        async def connect_rollout(address: str) -> NamedStub:
            if address not in replicas:
                ch = await stack.enter_async_context(aio_channel(address, token=token, tls=tls))
                replicas[address] = NamedStub(rollout_pb2_grpc.RolloutServiceStub(ch), "rollout", address, deadline,
                                              tracker)
            return replicas[address]

        trainer = NamedStub(trainer_pb2_grpc.TrainerServiceStub(await channel("trainer", trainer_address)),
                            "trainer", trainer_address, deadline, tracker)
        weightsync = None
        if weightsync_address:
            weightsync = NamedStub(weightsync_pb2_grpc.WeightSyncServiceStub(
                await channel("weightsync", weightsync_address)), "weightsync", weightsync_address, deadline,
                tracker)
        if rollout_addresses:  # a static fleet: every replica is waited for after a fault
            rollout = RolloutPool([NamedStub(rollout_pb2_grpc.RolloutServiceStub(await channel("rollout", a)),
                                             "rollout", a, deadline, tracker) for a in rollout_addresses],
                                  busy_wait_s=busy_wait)
        else:
            rollout = RolloutPool(discover=weightsync_fleet(weightsync, cfg.job_id), connect=connect_rollout,
                                  busy_wait_s=busy_wait)
        # JOB@vN teachers become adapters first, so a version weight sync cannot give ends the run before its job exists
        teachers = await read_version_teachers(cfg, teachers, weightsync, token, out, fresh=fresh)
        session = JobSession(cfg, trainer, out)
        state = await session.start(fresh=fresh)
        await session.serve_teachers(teachers)
        if not rollout_addresses:
            await rollout.wait_members(cfg.recovery.wait_s)
            print("lorarl: rollout replicas (from weight sync): " + ", ".join(
                f"{rollout.names[a]} at {a}" for a in rollout.members), flush=True)
        await rollout_warnings(cfg, rollout.stubs)
        log = RunLog(out, total_steps=cfg.loop.steps, tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb,
                     progress=cfg.output.progress, config=to_dict(cfg), wandb_settings=wandb_init(cfg),
                     success_reward=cfg.loop.success_reward)
        log.rewind(state.step if state.step else -1)  # rows past the resume point are redone; a fresh run starts clean

        async def recover():
            await wait_serving(channels, cfg.recovery.wait_s, give_up)
            if not rollout_addresses:
                await rollout.wait_members(cfg.recovery.wait_s)
            state = await session.recover()
            await session.serve_teachers(teachers)  # a restarted trainer lost them; weight sync renumbers them
            return state

        loop = RLLoop(cfg, trainer, rollout, reward, train, test, log, state=state, on_checkpoint=session.save,
                      weightsync=weightsync, recover=recover, on_rewind=log.rewind, workflow=workflow,
                      openai_urls=openai_urls, token=token, on_samples=log.samples, teachers=teachers)
        try:
            await run_watched(loop.run(), tracker, cfg.loop.stall)
        finally:
            log.close()
        exported = await trainer.Export(trainer_pb2.ExportRequest(job_id=cfg.job_id, mode=common_pb2.SYNC_MODE_ADAPTER,
                                                                  path=f"{cfg.job_id}/final-adapter"))
    plot = log.plot()
    summary = log.summary()
    (out / "summary.txt").write_text(summary + "\n")
    print("\n" + summary + f"\nplot: {plot}\nmetrics: {log.jsonl_path}\nadapter (PEFT): {exported.path}", flush=True)
    return 0
