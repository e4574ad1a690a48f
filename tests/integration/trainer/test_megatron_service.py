"""A JobConfig with engine "megatron" through the real TrainerService on loopback: train, resume, export."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lorarl.assets import MOE_MODEL_DIR
from lorarl.v1 import common_pb2, trainer_pb2
from tests.integration.trainer.test_trainer_service import BAD, GOOD, job_request, push, trajectory, with_stub


@pytest.mark.slow
def test_megatron_job_trains_resumes_and_exports_over_grpc(tmp_path: Path) -> None:
    async def body(stub) -> None:
        created = await stub.CreateJob(job_request(MOE_MODEL_DIR, engine="megatron",
                                                   megatron=trainer_pb2.MegatronConfig(tensor_parallel_size=1)))
        assert created.job.config.engine == "megatron"
        assert created.job.config.megatron.tensor_parallel_size == 1
        assert 0 < created.job.trainable_parameters < created.job.total_parameters
        probe = [trajectory(GOOD, 1.0), trajectory(BAD, 0.0)]
        before = await stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="job1", trajectories=probe))
        await push(stub, "job1", probe)
        first = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1"))
        assert first.version == 1 and {"loss", "grad_norm", "tokens"} <= set(first.metrics.values)
        saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id="job1"))
        batch = [trajectory(GOOD, 1.0, token_versions=[1] * 3), trajectory(BAD, 0.0, token_versions=[1] * 3)]
        once = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1", trajectories=batch))
        await stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(job_id="job1", path=saved.path))
        again = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1", trajectories=batch))
        assert again.metrics.values["loss"] == once.metrics.values["loss"] and again.version == 2
        after = await stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="job1", trajectories=probe))
        assert sum(after.results[0].logprobs) > sum(before.results[0].logprobs)
        exported = await stub.Export(trainer_pb2.ExportRequest(job_id="job1", mode=common_pb2.SYNC_MODE_ADAPTER))
        tensors = load_file(Path(exported.path) / "adapter_model.safetensors")
        assert "base_model.model.model.layers.0.mlp.experts.7.down_proj.lora_B.weight" in tensors
        merged = await stub.Export(trainer_pb2.ExportRequest(job_id="job1", mode=common_pb2.SYNC_MODE_MERGED))
        assert "model.layers.3.mlp.experts.7.up_proj.weight" in load_file(Path(merged.path) / "model.safetensors")

    asyncio.run(with_stub(tmp_path, body))


@pytest.mark.slow
def test_megatron_settings_on_another_engine_are_invalid(tmp_path: Path) -> None:
    import grpc

    async def body(stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CreateJob(job_request(MOE_MODEL_DIR, megatron=trainer_pb2.MegatronConfig(
                tensor_parallel_size=2)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "megatron" in err.value.details()

    asyncio.run(with_stub(tmp_path, body))
