"""Calls that carry no data for minutes survive clients' keepalive pings, on every service.

Clients ping a quiet connection (lorarl.common.channel); a server that does not accept pings that
often answers the third early one with GOAWAY ``too_many_pings`` and every call on the connection
fails UNAVAILABLE. With lorarl's 30 s pings that killed a quiet call after ~2 minutes. Here the same
failure is replayed in seconds: clients ping every second (gRPC's floor, via $LORARL_GRPC_KEEPALIVE_S),
the servers accept one every half second, and each call is held for more than five ping intervals
(a server with gRPC's default policy fails such a call after ~4 s, as the first test shows).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorarl.common.channel import KEEPALIVE_ENV, aio_channel, channel_options, client_keepalive_s
from lorarl.common.server import server_options, start_server
from lorarl.common.server_config import CLIENT_KEEPALIVE_S, ServerConfig
from lorarl.v1 import common_pb2, rollout_pb2, trainer_pb2, trainer_pb2_grpc, weightsync_pb2, weightsync_pb2_grpc
from lorarl.weightsync.client.agent import WeightSyncAgent
from lorarl.weightsync.client.publisher import WeightPublisher
from lorarl.weightsync.client.sinks import InMemorySink, PolicyUpdate

PING_S = 1.0  # what clients ask for; gRPC sends at most one ping a second anyway
SERVER_MIN_PING_S = 0.5
HOLD_S = 6.0  # > 5 ping intervals, and past the ~4 s a server with gRPC's default policy allows
TOKEN = "keepalive-test-token"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def fast_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEPALIVE_ENV, str(PING_S))


def quick_server(**kw: Any) -> ServerConfig:
    config = ServerConfig(port=0, metrics_port=-1, shutdown_grace_s=0.5, min_client_ping_interval_s=SERVER_MIN_PING_S,
                          **kw)
    config.auth.token = TOKEN
    return config


# ---------------------------------------------------------------------- the policy itself


def test_server_options_name_the_ping_policy_grpc_knows() -> None:
    options = dict(server_options(ServerConfig()))
    # The server-side argument gRPC reads (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS).
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
    assert "grpc.http2.min_recv_ping_interval_without_data_ms" not in options
    assert options["grpc.http2.min_ping_interval_without_data_ms"] < CLIENT_KEEPALIVE_S * 1000
    assert dict(channel_options())["grpc.keepalive_time_ms"] == int(PING_S * 1000)


def test_client_keepalive_env_is_validated() -> None:
    assert client_keepalive_s({}) == CLIENT_KEEPALIVE_S
    assert client_keepalive_s({KEEPALIVE_ENV: "45"}) == 45.0
    for bad in ("often", "0.2", "nan", "-3"):
        with pytest.raises(ValueError, match=KEEPALIVE_ENV):
            client_keepalive_s({KEEPALIVE_ENV: bad})


class SleepyTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    async def GetJob(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await asyncio.sleep(HOLD_S)
        return trainer_pb2.GetJobResponse()


async def held_get_job(config: ServerConfig) -> float:
    """Seconds a GetJob held for HOLD_S on a server with ``config`` took (raises what the call raised)."""
    def register(server: grpc.aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(SleepyTrainer(), server)
        return ["lorarl.v1.TrainerService"]

    server = await start_server("lorarl.v1.TrainerService", config, register)
    try:
        async with aio_channel(server.address, token=TOKEN) as channel:
            start = time.monotonic()
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetJob(trainer_pb2.GetJobRequest(job_id="j"))
            return time.monotonic() - start
    finally:
        await server.stop(0)


def test_a_quiet_call_dies_of_too_many_pings_where_the_server_refuses_them() -> None:
    """The failure the keepalive policy prevents, replayed: gRPC's default (one ping per 5 minutes)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(held_get_job(_refusing_server()))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "too many pings" in (info.value.details() or "").lower()


def _refusing_server() -> ServerConfig:
    """gRPC's own default: one ping per 5 minutes on a connection without data."""
    config = quick_server()
    config.min_client_ping_interval_s = 300.0
    return config


def test_a_quiet_call_outlives_five_ping_intervals() -> None:
    assert asyncio.run(held_get_job(quick_server())) >= HOLD_S


# ---------------------------------------------------------------------- the long calls of each service


def test_generate_waiting_on_a_paused_rollout_outlives_five_ping_intervals() -> None:
    from lorarl.rollout.config import RolloutSettings
    from tests.integration.rollout.harness import RolloutHarness, greedy
    from tests.unit.rollout.models import PROMPT, dense_model_dir

    settings = RolloutSettings(model_path=str(dense_model_dir()), engine="hf", dtype="float32", max_model_len=256)
    harness = RolloutHarness(settings, server=quick_server()).start()
    try:
        harness.stub.Pause(rollout_pb2.PauseRequest())
        resume = threading.Timer(HOLD_S, lambda: harness.stub.Resume(rollout_pb2.ResumeRequest()))
        resume.start()
        try:
            start = time.monotonic()
            response = harness.stub.Generate(rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=greedy(4)), timeout=60)
            assert time.monotonic() - start >= HOLD_S
            assert len(response.results[0].completions[0].token_ids) == 4
        finally:
            resume.join()
    finally:
        harness.close()


def test_a_train_step_of_several_ping_intervals_completes(tmp_path: Path) -> None:
    from lorarl.trainer.service.config import TrainerSettings
    from lorarl.trainer.service.server import NAME, TrainerServicer, registration
    from tests.unit.trainer.tiny import dense_model

    model_dir = tmp_path / "model"
    dense_model(seed=0).save_pretrained(model_dir)

    def batch(n: int) -> list[common_pb2.Trajectory]:
        completion = [(7 * i) % 90 + 5 for i in range(48)]
        return [common_pb2.Trajectory(prompt_token_ids=[3, 7, 11, 13], completion_token_ids=completion,
                                      behavior_logprobs=[-1.0] * len(completion),
                                      token_versions=[0] * len(completion), reward=float(i % 2), group_id=f"g{i // 4}",
                                      finish_reason=common_pb2.FINISH_REASON_STOP) for i in range(n)]

    async def scenario() -> None:
        settings = TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "export"))
        server = await start_server(NAME, quick_server(), registration(TrainerServicer(settings)))
        try:
            async with aio_channel(server.address, token=TOKEN) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                await stub.CreateJob(trainer_pb2.CreateJobRequest(job_id="long", config=trainer_pb2.JobConfig(
                    base_model_path=str(model_dir), lora=common_pb2.LoraSpec(rank=4, alpha=8),
                    optimizer=trainer_pb2.OptimizerConfig(learning_rate=1e-3), seed=1)))
                # Size the step so that it computes for ~1.5 x HOLD_S on this machine (warm: the first step pays
                # for lazy set-up), doubling it while a step is too short to prove anything.
                n, held, version = 32, 0.0, 0
                while held < HOLD_S and n <= 200_000:
                    start = time.monotonic()
                    response = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="long",
                                                                                 trajectories=batch(n)))
                    held = time.monotonic() - start
                    version += 1
                    assert response.version == version and response.metrics.values["sequences"] == n
                    n = max(2 * n, int(1.5 * HOLD_S * n / held)) if held < HOLD_S else n
                assert held >= HOLD_S, f"no step took {HOLD_S} s (the last: {held:.1f} s)"
        finally:
            await server.stop(0)

    asyncio.run(scenario())


class SlowStagingSink(InMemorySink):
    """Takes HOLD_S to stage, so the version's activation stays pending that long."""

    def stage(self, update: PolicyUpdate) -> None:
        time.sleep(HOLD_S)
        super().stage(update)


def test_an_idle_subscribe_and_a_pending_await_activation_outlive_five_ping_intervals(tmp_path: Path) -> None:
    from tests.integration.weightsync import harness
    from tests.integration.weightsync.tiny import FINGERPRINT, TinyTrainer, lora_spec

    @contextlib.asynccontextmanager
    async def subscribed(target: str, sink: InMemorySink) -> AsyncIterator[WeightSyncAgent]:
        caps = weightsync_pb2.ReplicaCapabilities(supports_lora=True, max_lora_rank=64, max_loras=2, engine="test")
        agent = WeightSyncAgent(target, sink, replica_id="r0", token=harness.TOKEN, capabilities=caps)
        task = asyncio.create_task(agent.run())
        try:
            yield agent
        finally:
            agent.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)

    async def scenario() -> None:
        overrides = harness.service_overrides(tmp_path)
        overrides += [f"server.min_client_ping_interval_s={SERVER_MIN_PING_S}"]
        sink = SlowStagingSink()
        async with _weightsync(overrides) as running, subscribed(running.address, sink) as agent:
            for _ in range(100):
                if agent.connected:
                    break
                await asyncio.sleep(0.05)
            assert agent.connected
            await asyncio.sleep(HOLD_S)  # the Subscribe stream carries nothing all this time
            assert agent.subscriptions == 1, "the idle Subscribe stream was dropped and re-opened"
            trainer = TinyTrainer()
            async with WeightPublisher(running.address, token=harness.TOKEN, collective=False) as pub:
                await pub.register_job("job", base_model_fingerprint=FINGERPRINT, lora=lora_spec(),
                                       catalog=trainer.catalog(), mode=common_pb2.SYNC_MODE_ADAPTER)
                trainer.step(1)
                publish = asyncio.create_task(pub.publish("job", 1, adapter=trainer.adapter(), wait=False))
                async with aio_channel(running.address, token=harness.TOKEN) as channel:
                    stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
                    await publish
                    start = time.monotonic()
                    outcome = await stub.AwaitActivation(weightsync_pb2.AwaitActivationRequest(
                        job_id="job", version=1, timeout_seconds=60))
                    assert time.monotonic() - start >= HOLD_S - 1.0
                assert outcome.outcome == weightsync_pb2.ACTIVATION_OUTCOME_ACTIVE
            assert agent.subscriptions == 1
            assert sink.active["job"].version == 1

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def _weightsync(overrides: list[str]) -> AsyncIterator[Any]:
    from lorarl.common.config import load_config
    from lorarl.weightsync.service.config import WeightSyncServiceConfig
    from lorarl.weightsync.service.server import start_weightsync

    config = load_config(WeightSyncServiceConfig, overrides=overrides, env={})
    running, _ = await start_weightsync(config)
    try:
        yield running
    finally:
        await running.stop(0)
