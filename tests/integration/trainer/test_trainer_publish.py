"""TrainerService.PublishWeights through the real weight-sync service to a subscribed replica."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch

from lorarl.common.channel import aio_channel
from lorarl.common.server import start_server
from lorarl.common.server_config import ServerConfig
from lorarl.trainer.service.config import TrainerSettings
from lorarl.trainer.service.server import NAME, TrainerServicer, registration
from lorarl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc, weightsync_pb2
from lorarl.weightsync.client.agent import WeightSyncAgent
from lorarl.weightsync.client.sinks import InMemorySink
from tests.integration.trainer.test_trainer_service import BAD, GOOD, job_request, push, trajectory
from tests.integration.weightsync.harness import TOKEN, eventually, running_service
from tests.unit.trainer.tiny import dense_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
GLOO = common_pb2.COLLECTIVE_BACKEND_GLOO


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    dense_model(seed=0).save_pretrained(path)
    return path


@contextlib.asynccontextmanager
async def trainer(tmp_path: Path, weightsync: str, collective: bool):
    settings = TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "export"),
                               weightsync_address=weightsync, collective=collective)
    config = ServerConfig(port=0)
    config.auth.token = TOKEN
    servicer = TrainerServicer(settings, token=TOKEN)
    server = await start_server(NAME, config, registration(servicer), on_shutdown=servicer.close)
    try:
        async with aio_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
            yield trainer_pb2_grpc.TrainerServiceStub(channel), servicer
    finally:
        await server.stop(0)


@pytest.mark.parametrize("collective", [True, False], ids=["gloo", "inline"])
def test_published_adapter_reaches_replica(tmp_path: Path, model_dir: Path, collective: bool) -> None:
    async def body() -> None:
        async with running_service(tmp_path / "ws") as (ws, _), \
                trainer(tmp_path, f"127.0.0.1:{ws.port}", collective) as (stub, servicer):
            sink = InMemorySink()
            caps = weightsync_pb2.ReplicaCapabilities(supports_lora=True, max_lora_rank=64, max_loras=4,
                                                      collective_backends=[GLOO] if collective else [])
            agent = WeightSyncAgent(f"127.0.0.1:{ws.port}", sink, replica_id="r0", capabilities=caps,
                                    token=TOKEN, job_ids=["job1"])
            task = asyncio.create_task(agent.run())
            try:
                await eventually(lambda: agent.connected, 10, "replica subscribed")
                await stub.CreateJob(job_request(model_dir))
                with pytest.raises(Exception, match="version 0"):
                    await stub.PublishWeights(trainer_pb2.PublishWeightsRequest(job_id="job1"))
                await push(stub, "job1", [trajectory(GOOD, 1.0), trajectory(BAD, 0.0)])
                await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1"))
                published = await stub.PublishWeights(trainer_pb2.PublishWeightsRequest(
                    job_id="job1", wait_for_activation=True, timeout_seconds=60))
                assert published.activated, published.error
                assert published.version == 1 and published.mode == common_pb2.SYNC_MODE_ADAPTER
                assert published.transport == ("collective" if collective else "inline")
                assert sink.active_versions() == {"job1": 1}
                engine = servicer.jobs.get("job1").engine
                expected = dict(engine.iter_adapter_tensors())
                got = sink.active["job1"].tensors
                assert got.keys() == expected.keys()
                assert all(torch.equal(got[k], expected[k]) for k in expected)
                again = await stub.PublishWeights(trainer_pb2.PublishWeightsRequest(job_id="job1"))
                assert again.duplicate
            finally:
                agent.stop()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(task, 10)

    asyncio.run(body())


def test_publish_without_weightsync_is_failed_precondition(tmp_path: Path, model_dir: Path) -> None:
    import grpc

    async def body() -> None:
        async with trainer(tmp_path, "", True) as (stub, _):
            await stub.CreateJob(job_request(model_dir))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PublishWeights(trainer_pb2.PublishWeightsRequest(job_id="job1"))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "weightsync_address" in err.value.details()

    asyncio.run(body())


def test_a_restarted_trainer_resumes_above_every_version_weight_sync_holds(tmp_path: Path, model_dir: Path) -> None:
    """Trainer A publishes v1, checkpoints, publishes v2 and dies; trainer B re-creates the job, loads the
    checkpoint (version 1) and publishes: the weights of v1 come back as v3, never as a second v2."""
    import grpc

    async def body() -> None:
        async with running_service(tmp_path / "ws") as (ws, _):
            sink = InMemorySink()
            caps = weightsync_pb2.ReplicaCapabilities(supports_lora=True, max_lora_rank=64, max_loras=4)
            agent = WeightSyncAgent(f"127.0.0.1:{ws.port}", sink, replica_id="r0", capabilities=caps,
                                    token=TOKEN, job_ids=["job1"])
            task = asyncio.create_task(agent.run())
            request = job_request(model_dir)
            request.attach = True
            try:
                await eventually(lambda: agent.connected, 10, "replica subscribed")
                async with trainer(tmp_path, f"127.0.0.1:{ws.port}", False) as (stub, servicer):
                    first = await stub.CreateJob(request)
                    assert not first.attached
                    again = await stub.CreateJob(request)  # a client that restarted re-attaches
                    assert again.attached and again.job.step == 0
                    with pytest.raises(grpc.aio.AioRpcError) as taken:  # without attach: taken
                        await stub.CreateJob(job_request(model_dir))
                    assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
                    other = job_request(model_dir)
                    other.attach, other.config.seed = True, 2
                    with pytest.raises(grpc.aio.AioRpcError) as differs:  # attach to another config: refused
                        await stub.CreateJob(other)
                    assert differs.value.code() == grpc.StatusCode.ALREADY_EXISTS
                    assert "different configuration" in differs.value.details()
                    for version in (1, 2):
                        await push(stub, "job1", [trajectory(GOOD, 1.0), trajectory(BAD, 0.0)])
                        await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1"))
                        published = await stub.PublishWeights(trainer_pb2.PublishWeightsRequest(
                            job_id="job1", wait_for_activation=True, timeout_seconds=60))
                        assert published.activated and published.version == version
                        if version == 1:
                            saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(
                                job_id="job1", path="job1/resume"))
                            v1 = {k: t.clone() for k, t in servicer.jobs.get("job1").engine.iter_adapter_tensors()}
                async with trainer(tmp_path, f"127.0.0.1:{ws.port}", False) as (stub, servicer):
                    assert not (await stub.CreateJob(request)).attached  # the new process holds no job
                    loaded = await stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(job_id="job1",
                                                                                        path=saved.path))
                    assert loaded.version == 1 and loaded.step == 1
                    published = await stub.PublishWeights(trainer_pb2.PublishWeightsRequest(
                        job_id="job1", wait_for_activation=True, timeout_seconds=60))
                    assert published.activated, published.error
                    assert published.version == 3
                    assert (await stub.GetJob(trainer_pb2.GetJobRequest(job_id="job1"))).job.version == 3
                    assert sink.active_versions() == {"job1": 3}
                    got = sink.active["job1"].tensors
                    assert all(torch.equal(got[k], v1[k]) for k in v1)  # v3 holds v1's weights
                    # Training continues upward from there.
                    await push(stub, "job1", [trajectory(GOOD, 1.0, token_versions=[3] * 3),
                                              trajectory(BAD, 0.0, token_versions=[3] * 3)])
                    step = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1"))
                    assert step.version == 4
            finally:
                agent.stop()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(task, 10)

    asyncio.run(body())
