"""Per-job credentials on one trainer, over real gRPC: a tenant's key reaches its own jobs and no other's.

Two tenants (team-a-*, team-b-*) and the operator's service token share a trainer and a base model. Every
job RPC with A's key on B's job is PERMISSION_DENIED; A lists only its own; its paths stay in its folders.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from lorarl.common.channel import aio_channel
from lorarl.common.server import start_server
from lorarl.common.server_config import ServerConfig
from lorarl.trainer.service.config import TenantKey, TrainerSettings
from lorarl.trainer.service.server import NAME, TrainerServicer, registration
from lorarl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from tests.integration.trainer.test_trainer_service import GOOD, job_request, trajectory
from tests.unit.trainer.tiny import dense_model

OPERATOR, KEY_A, KEY_B = "operator-token", "key-of-team-a", "key-of-team-b"
MODELS: list[Path] = []  # the module's model directory, for the trainer's model_roots


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    dense_model(seed=0).save_pretrained(path)
    MODELS[:] = [path]
    return path


async def trainer(tmp_path: Path, body) -> None:
    settings = TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "export"),
                               model_roots=[str(MODELS[0].parent), str(tmp_path)],
                               tenants=[TenantKey(name="team a", token=KEY_A, jobs=["team-a-*"]),
                                        TenantKey(name="team b", token=KEY_B, jobs=["team-b-*"])])
    config = ServerConfig(port=0)
    config.auth.token = OPERATOR
    servicer = TrainerServicer(settings)
    server = await start_server(NAME, config, registration(servicer), also_tokens=servicer.tenants.tokens)
    try:
        address = f"127.0.0.1:{server.port}"
        async with aio_channel(address, token=OPERATOR) as op, aio_channel(address, token=KEY_A) as a, \
                aio_channel(address, token=KEY_B) as b, aio_channel(address, token="a-guess") as guess:
            await body(*(trainer_pb2_grpc.TrainerServiceStub(c) for c in (op, a, b, guess)))
    finally:
        await server.stop(0)


async def denied(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED, raised.value.details()
    return raised.value.details()


def test_a_tenants_key_reaches_its_own_jobs_and_none_of_anothers(tmp_path: Path, model_dir: Path) -> None:
    async def body(operator, a, b, guess) -> None:
        assert (await a.CreateJob(job_request(model_dir, "team-a-1"))).job.job_id == "team-a-1"
        message = await denied(a.CreateJob(job_request(model_dir, "team-b-1")))
        assert "tenant 'team a' may use jobs ['team-a-*']" in message and "team-b-1" in message
        await b.CreateJob(job_request(model_dir, "team-b-1"))
        await operator.CreateJob(job_request(model_dir, "ops-1"))
        # Every job RPC with A's key on B's job is refused; B's job is untouched.
        job = "team-b-1"
        push = trainer_pb2.PushTrajectoriesRequest(job_id=job, trajectories=[trajectory(GOOD, 1.0)])
        for call in (a.GetJob(trainer_pb2.GetJobRequest(job_id=job)),
                     a.TrainStep(trainer_pb2.TrainStepRequest(job_id=job, trajectories=[trajectory(GOOD, 1.0)])),
                     a.ForwardBackward(trainer_pb2.ForwardBackwardRequest(job_id=job)),
                     a.OptimStep(trainer_pb2.OptimStepRequest(job_id=job)),
                     a.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id=job)),
                     a.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id=job)),
                     a.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(job_id=job, path="x")),
                     a.Export(trainer_pb2.ExportRequest(job_id=job, mode=common_pb2.SYNC_MODE_ADAPTER)),
                     a.PublishWeights(trainer_pb2.PublishWeightsRequest(job_id=job)),
                     a.DeleteJob(trainer_pb2.DeleteJobRequest(job_id=job))):
            await denied(call)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in a.PushTrajectories(iter([push]))]
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
        status = await b.GetJob(trainer_pb2.GetJobRequest(job_id=job))
        assert (status.job.version, status.job.buffered_trajectories) == (0, 0)
        # Each sees its own jobs; the operator sees all.
        listed = {k: sorted(j.job_id for j in (await s.ListJobs(trainer_pb2.ListJobsRequest())).jobs)
                  for k, s in (("a", a), ("b", b), ("operator", operator))}
        assert listed == {"a": ["team-a-1"], "b": ["team-b-1"], "operator": ["ops-1", "team-a-1", "team-b-1"]}
        # A's files stay in A's job folders: its default export lands there, and a path to B's is refused.
        await a.TrainStep(trainer_pb2.TrainStepRequest(job_id="team-a-1", trajectories=[trajectory(GOOD, 1.0)]))
        exported = await a.Export(trainer_pb2.ExportRequest(job_id="team-a-1", mode=common_pb2.SYNC_MODE_ADAPTER))
        assert Path(exported.path).parent == (tmp_path / "export" / "team-a-1").resolve()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await a.Export(trainer_pb2.ExportRequest(job_id="team-a-1", mode=common_pb2.SYNC_MODE_ADAPTER,
                                                     path="../team-b-1/adapter"))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await a.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id="team-a-1", path="../team-b-1/step"))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # ... and a job of A's may not start from B's exports (its adapter as a warm start, its merged weights).
        theirs = await b.Export(trainer_pb2.ExportRequest(job_id="team-b-1", mode=common_pb2.SYNC_MODE_MERGED))
        stolen = job_request(model_dir, "team-a-2")
        stolen.config.base_model_path = theirs.path
        assert "is job 'team-b-1''s" in await denied(a.CreateJob(stolen))
        mine = job_request(model_dir, "team-a-3")
        mine.config.init_adapter_path = exported.path  # its own job's adapter: allowed
        assert (await a.CreateJob(mine)).job.version == 1
        # A key that is no tenant's is not let in at all.
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await guess.ListJobs(trainer_pb2.ListJobsRequest())
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await operator.DeleteJob(trainer_pb2.DeleteJobRequest(job_id="team-b-1"))  # the operator reaches every job

    asyncio.run(trainer(tmp_path, body))


def test_tenant_keys_are_checked_when_the_trainer_starts() -> None:
    from lorarl.common.config import ConfigError, from_dict
    from lorarl.trainer.service.tenancy import Tenants

    with pytest.raises(ConfigError, match=r"trainer\.tenants\[0\]\.jobs: names no job"):
        from_dict(TrainerSettings, {"tenants": [{"name": "x", "token": "k"}]}, key="trainer")
    with pytest.raises(ConfigError, match="two tenants share a key"):
        Tenants.from_settings([TenantKey(name="x", token="k", jobs=["a"]), TenantKey(name="y", token="k", jobs=["b"])])
    with pytest.raises(ConfigError, match="has no key"):
        Tenants.from_settings([TenantKey(name="x", jobs=["a"])])
    from lorarl.trainer.service.server import TrainerServicer

    with pytest.raises(ConfigError, match=r"trainer\.model_roots: is required with trainer\.tenants"):
        TrainerServicer(TrainerSettings(tenants=[TenantKey(name="x", token="k", jobs=["a"])]))
