"""TrainerService over a real gRPC server on loopback, on a tiny Qwen3 model."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest

from lorarl.common.channel import aio_channel
from lorarl.common.server import start_server
from lorarl.common.server_config import ServerConfig
from lorarl.trainer.service.config import TrainerSettings
from lorarl.trainer.service.server import NAME, TrainerServicer, registration
from lorarl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from tests.unit.trainer.tiny import dense_model

TOKEN = "trainer-test-token"
PROMPT = [3, 7, 11, 13]
GOOD = [21, 22, 23]
BAD = [40, 41, 42]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    dense_model(seed=0).save_pretrained(path)
    return path


def trajectory(completion: list[int], reward: float, **kw) -> common_pb2.Trajectory:
    fields = dict(prompt_token_ids=PROMPT, completion_token_ids=completion,
                  behavior_logprobs=[-1.0] * len(completion), token_versions=[0] * len(completion),
                  reward=reward, group_id="g0", finish_reason=common_pb2.FINISH_REASON_STOP)
    fields.update(kw)
    return common_pb2.Trajectory(**fields)


async def with_stub(tmp_path: Path, body, with_address: bool = False) -> None:
    """Runs ``body(stub)`` (``body(stub, address)`` with ``with_address``) against a trainer on loopback."""
    settings = TrainerSettings(checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "export"))
    config = ServerConfig(port=0)
    config.auth.token = TOKEN
    server = await start_server(NAME, config, registration(TrainerServicer(settings)))
    try:
        address = f"127.0.0.1:{server.port}"
        async with aio_channel(address, token=TOKEN) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            await (body(stub, address) if with_address else body(stub))
    finally:
        await server.stop(0)


def job_request(model_dir: Path, job_id: str = "job1", **config) -> trainer_pb2.CreateJobRequest:
    cfg = trainer_pb2.JobConfig(base_model_path=str(model_dir),
                                lora=common_pb2.LoraSpec(rank=4, alpha=8),
                                optimizer=trainer_pb2.OptimizerConfig(learning_rate=5e-2), seed=1, **config)
    return trainer_pb2.CreateJobRequest(job_id=job_id, config=cfg)


async def refused(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(request)
    return err.value.code(), err.value.details()


async def push(stub, job_id: str, *batches: list[common_pb2.Trajectory]) -> list[trainer_pb2.PushTrajectoriesResponse]:
    async def requests():
        for batch in batches:
            yield trainer_pb2.PushTrajectoriesRequest(job_id=job_id, trajectories=batch)

    return [r async for r in stub.PushTrajectories(requests())]


@pytest.mark.slow
def test_training_moves_policy_towards_rewarded_completion(tmp_path: Path, model_dir: Path) -> None:
    async def body(stub) -> None:
        created = await stub.CreateJob(job_request(model_dir))
        assert created.job.version == 0 and created.job.trainable_parameters > 0
        assert created.job.trainable_parameters < created.job.total_parameters
        probe = [trajectory(GOOD, 1.0), trajectory(BAD, 0.0)]
        before = await stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="job1", trajectories=probe))
        for step in range(3):
            # On-policy behaviour logprobs, as a rollout of the current version would report them.
            current = await stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="job1",
                                                                                    trajectories=probe))
            responses = await push(stub, "job1", [
                trajectory(GOOD, 1.0, token_versions=[step] * 3, behavior_logprobs=current.results[0].logprobs),
                trajectory(BAD, 0.0, token_versions=[step] * 3, behavior_logprobs=current.results[1].logprobs)])
            assert responses[0].accepted == 2
            result = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1"))
            assert result.version == step + 1
            assert {"loss", "grad_norm", "tokens"} <= set(result.metrics.values)
        after = await stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="job1", trajectories=probe))
        assert sum(after.results[0].logprobs) > sum(before.results[0].logprobs) + 0.1
        assert sum(after.results[1].logprobs) < sum(before.results[1].logprobs) - 0.1
        ref = await stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="job1", trajectories=probe,
                                                                            reference=True))
        assert list(ref.results[0].logprobs) == pytest.approx(list(before.results[0].logprobs), abs=1e-5)
        status = await stub.GetJob(trainer_pb2.GetJobRequest(job_id="job1"))
        assert status.job.version == 3 and status.job.buffered_trajectories == 0

    asyncio.run(with_stub(tmp_path, body))


@pytest.mark.slow
def test_bad_trajectories_are_refused_individually(tmp_path: Path, model_dir: Path) -> None:
    async def body(stub) -> None:
        await stub.CreateJob(job_request(model_dir, max_buffered_trajectories=3))
        batch = [
            trajectory(GOOD, 1.0),
            trajectory(GOOD, 1.0, behavior_logprobs=[-1.0]),  # length mismatch
            trajectory([10_000], 1.0, behavior_logprobs=[-1.0], token_versions=[0]),  # outside vocab
            trajectory(GOOD, 1.0, behavior_logprobs=[-1.0, float("nan"), -1.0]),
            trajectory(GOOD, 1.0, behavior_logprobs=[-1.0, 0.5, -1.0]),
            trajectory(GOOD, 1.0, token_versions=[0, 9, 0]),  # ahead of the trainer
            trajectory(GOOD, float("inf")),
            trajectory(BAD, 0.0),
        ]
        (first,) = await push(stub, "job1", batch)
        fields = [s.field for s in first.statuses]
        codes = [s.code for s in first.statuses]
        assert codes[0] == 0 and codes[-1] == 0
        assert fields[1:7] == ["behavior_logprobs", "completion_token_ids", "behavior_logprobs",
                               "behavior_logprobs", "token_versions", "reward"]
        assert all(c == grpc.StatusCode.INVALID_ARGUMENT.value[0] for c in codes[1:7])
        assert first.accepted == 2 and first.buffered_trajectories == 2
        second, third = await push(stub, "job1", [trajectory(BAD, 0.0)], [trajectory(BAD, 0.0)])
        assert second.accepted == 1
        assert third.accepted == 0 and third.statuses[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        status = await stub.GetJob(trainer_pb2.GetJobRequest(job_id="job1"))
        assert status.job.buffered_trajectories == 3  # everything accepted is kept
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.TrainStep(trainer_pb2.TrainStepRequest(
                job_id="job1", trajectories=[trajectory(GOOD, 1.0, prompt_token_ids=[])]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "trajectories[0].prompt_token_ids" in err.value.details()
        status = await stub.GetJob(trainer_pb2.GetJobRequest(job_id="job1"))
        assert status.job.buffered_trajectories == 3 and status.job.version == 0

    asyncio.run(with_stub(tmp_path, body))


@pytest.mark.slow
def test_job_errors_have_clear_statuses(tmp_path: Path, model_dir: Path) -> None:
    async def body(stub) -> None:
        async def code_of(call, request) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request)
            return err.value.code(), err.value.details()

        code, msg = await code_of(stub.GetJob, trainer_pb2.GetJobRequest(job_id="nope"))
        assert code == grpc.StatusCode.NOT_FOUND and "nope" in msg
        code, msg = await code_of(stub.CreateJob, job_request(tmp_path / "missing"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "config.base_model_path" in msg
        bad_lr = job_request(model_dir)
        bad_lr.config.optimizer.learning_rate = -1
        code, msg = await code_of(stub.CreateJob, bad_lr)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "optimizer.learning_rate" in msg
        bad_lora = job_request(model_dir)
        bad_lora.config.lora.target_modules.append("attn")
        code, msg = await code_of(stub.CreateJob, bad_lora)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "target_modules" in msg
        code, msg = await code_of(stub.CreateJob, job_request(model_dir, job_id="bad id!"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "job_id" in msg
        await stub.CreateJob(job_request(model_dir))
        code, _ = await code_of(stub.CreateJob, job_request(model_dir))
        assert code == grpc.StatusCode.ALREADY_EXISTS
        code, msg = await code_of(stub.TrainStep, trainer_pb2.TrainStepRequest(job_id="job1"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no trajectories" in msg
        code, msg = await code_of(stub.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest(job_id="job1",
                                                                                           path="/etc/evil"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside" in msg

    asyncio.run(with_stub(tmp_path, body))


@pytest.mark.slow
def test_checkpoint_resume_and_export_over_grpc(tmp_path: Path, model_dir: Path) -> None:
    async def body(stub) -> None:
        await stub.CreateJob(job_request(model_dir))
        await push(stub, "job1", [trajectory(GOOD, 1.0), trajectory(BAD, 0.0)])
        await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1"))
        saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id="job1"))
        assert saved.step == 1 and Path(saved.path).is_dir()
        batch = [trajectory(GOOD, 1.0, token_versions=[1] * 3), trajectory(BAD, 0.0, token_versions=[1] * 3)]
        first = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1", trajectories=batch))
        loaded = await stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(job_id="job1", path=saved.path))
        assert loaded.step == 1 and loaded.version == 1
        again = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job1", trajectories=batch))
        assert again.metrics.values["loss"] == first.metrics.values["loss"]
        exported = await stub.Export(trainer_pb2.ExportRequest(job_id="job1", mode=common_pb2.SYNC_MODE_ADAPTER))
        assert (Path(exported.path) / "adapter_model.safetensors").is_file()
        merged = await stub.Export(trainer_pb2.ExportRequest(job_id="job1", mode=common_pb2.SYNC_MODE_MERGED))
        assert (Path(merged.path) / "model.safetensors").is_file()
        # retention: step checkpoints beyond the newest keep_last go as each new one is saved; others stay
        resume = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id="job1", path="job1/resume"))
        removed = []
        for step in (2, 3, 4):  # beside step-000001, saved above
            saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(
                job_id="job1", path=f"job1/step-{step:06d}", keep_last=2))
            removed.append([Path(p).name for p in saved.removed])
        assert removed == [[], ["step-000001"], ["step-000002"]]
        on_disk = sorted(p.name for p in Path(saved.path).parent.iterdir())
        assert on_disk == ["resume", "step-000003", "step-000004"] and Path(resume.path).is_dir(), on_disk
        await stub.DeleteJob(trainer_pb2.DeleteJobRequest(job_id="job1"))
        listed = await stub.ListJobs(trainer_pb2.ListJobsRequest())
        assert list(listed.jobs) == []

    asyncio.run(with_stub(tmp_path, body))


def test_out_of_range_and_non_finite_inputs_are_invalid_argument(tmp_path: Path, model_dir: Path) -> None:
    """What a fuzz of the trainer's RPCs found answered with INTERNAL or accepted: each is now refused by name."""
    async def body(stub) -> None:
        def with_config(**changes) -> trainer_pb2.CreateJobRequest:
            request = job_request(model_dir)
            for path, value in changes.items():
                target = request.config
                *parents, leaf = path.split("__")
                for parent in parents:
                    target = getattr(target, parent)
                setattr(target, leaf, value)
            return request

        for field, value in [("lora__alpha", math.nan), ("lora__alpha", math.inf), ("lora__rank", 2**32 - 1),
                             ("lora__rank", 100_000), ("optimizer__learning_rate", math.nan),
                             ("loss__clip_eps_low", math.nan), ("loss__kl_coef", math.inf)]:
            code, msg = await refused(stub.CreateJob, with_config(**{field: value}))
            name = field.split("__")[-1]
            assert code == grpc.StatusCode.INVALID_ARGUMENT and name in msg, (field, value, code, msg)
        code, msg = await refused(stub.CreateJob, with_config(device="cuda:99"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no cuda device" in msg  # this machine has none
        code, msg = await refused(stub.CreateJob, job_request(model_dir, job_id="evil\nid"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "job_id" in msg
        code, msg = await refused(stub.CreateJob, job_request(model_dir, job_id="x" * 10_000))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and len(msg) < 400  # the id is quoted, cut short

        await stub.CreateJob(job_request(model_dir, job_id="ok"))
        for path in ("ckpt\x00evil", "a" * 5000):
            code, msg = await refused(stub.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest(job_id="ok", path=path))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "path" in msg and len(msg) < 400
        await stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            job_id="ok", trajectories=[trajectory([5, 6], 1.0), trajectory([7, 8], 0.0)]))
        code, msg = await refused(stub.OptimStep, trainer_pb2.OptimStepRequest(job_id="ok", learning_rate=math.nan))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "learning_rate" in msg

    asyncio.run(with_stub(tmp_path, body))


def test_two_jobs_on_one_base_share_it_over_grpc(tmp_path: Path, model_dir: Path, capsys) -> None:
    """Two CreateJob calls on one model: one resident base, each job's own adapter and numbers; `lorarl jobs`
    lists them."""
    from lorarl.client import cli

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)

    async def body(stub, address: str) -> None:
        one = await stub.CreateJob(job_request(model_dir, "one"))
        request = job_request(model_dir, "two")
        request.config.lora.rank, request.config.lora.alpha = 8, 16
        two = await stub.CreateJob(request)
        assert two.job.base_jobs == 2 and two.job.base_bytes == one.job.base_bytes > 0
        assert two.job.trainable_parameters == 2 * one.job.trainable_parameters
        for job_id in ("one", "two"):
            await push(stub, job_id, [trajectory(GOOD, 1.0), trajectory(BAD, 0.0)])
        trained = await stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="two"))
        assert trained.version == 1
        statuses = {j.job_id: j for j in (await stub.ListJobs(trainer_pb2.ListJobsRequest())).jobs}
        assert (statuses["one"].version, statuses["two"].version) == (0, 1)
        assert statuses["two"].trained_tokens == trained.metrics.values["tokens"] > 0
        assert statuses["two"].tokens_per_second > 0 and statuses["one"].trained_tokens == 0
        # adapter + Adam's two moments once trained (fp32): 3 x 4 bytes a parameter (and a step count per
        # tensor); before its first step, 4
        assert statuses["two"].job_bytes == pytest.approx(12 * two.job.trainable_parameters, rel=0.01)
        assert statuses["one"].job_bytes == 4 * one.job.trainable_parameters
        capsys.readouterr()
        assert await asyncio.to_thread(cli.main, ["jobs", "--trainer", address, "--token-file", str(token_file)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[:3] == ["job", "base", "rank"] and len(lines) == 3
        assert lines[2].split()[:5] == ["two", str(model_dir), "8", "1", "1"] and lines[2].endswith("(2)")
        assert float(lines[2].split()[6].replace(",", "")) > 0 and lines[1].split()[6] == "0.0"  # tokens/s
        assert lines[2].split()[7] == "1" and float(lines[2].split()[8]) >= 0  # share, seconds waited for turns
        assert statuses["two"].base_turns >= 1 and statuses["one"].base_turns == 0
        await stub.DeleteJob(trainer_pb2.DeleteJobRequest(job_id="two"))
        left = await stub.GetJob(trainer_pb2.GetJobRequest(job_id="one"))
        assert left.job.base_jobs == 1 and left.job.base_bytes == one.job.base_bytes

    asyncio.run(with_stub(tmp_path, body, with_address=True))


def test_a_per_token_loss_over_grpc_returns_logprobs_and_refuses_what_it_cannot_read(tmp_path: Path,
                                                                                  model_dir: Path) -> None:
    """ForwardBackward with the caller's per-token advantages (the Tinker front's call): forward_only and
    return_logprobs give the policy's logprobs and the summed loss; advantages sent to a group loss, or missing
    where the loss needs them, are INVALID_ARGUMENT naming the field."""
    is_loss = trainer_pb2.LossConfig(type=trainer_pb2.LOSS_TYPE_IMPORTANCE_SAMPLING)

    async def body(stub) -> None:
        await stub.CreateJob(job_request(model_dir))
        sent = [trajectory(GOOD, 0.0, token_advantages=[1.0, 0.5, -0.25]), trajectory(BAD, 0.0,
                                                                                     token_advantages=[-1.0] * 3)]
        scored = await stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="job1", trajectories=sent))
        forward = await stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            job_id="job1", trajectories=sent, loss=is_loss, forward_only=True, return_logprobs=True))
        assert [lp for r in forward.logprobs for lp in r.logprobs] == pytest.approx(
            [lp for r in scored.results for lp in r.logprobs], abs=1e-5) and len(forward.logprobs) == 2
        expected = -sum(math.exp(lp + 1.0) * a for t, r in zip(sent, scored.results, strict=True)
                        for lp, a in zip(r.logprobs, t.token_advantages, strict=True))
        assert forward.metrics.values["loss"] == pytest.approx(expected, rel=1e-4)
        with_grad = await stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            job_id="job1", trajectories=sent, loss=is_loss, return_logprobs=True))
        assert len(with_grad.logprobs) == 2
        stepped = await stub.OptimStep(trainer_pb2.OptimStepRequest(job_id="job1"))
        assert stepped.version == 1

        code, msg = await refused(stub.ForwardBackward, trainer_pb2.ForwardBackwardRequest(job_id="job1",
                                                                                           trajectories=sent))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "trajectories[0].token_advantages" in msg
        assert "(grpo)" in msg
        code, msg = await refused(stub.ForwardBackward, trainer_pb2.ForwardBackwardRequest(
            job_id="job1", trajectories=[trajectory(GOOD, 1.0)], loss=is_loss))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "needed by loss importance_sampling" in msg
        pushed = await push(stub, "job1", [sent[0]])
        assert "token_advantages" in pushed[0].statuses[0].message  # buffered: trained under the job's grpo

    asyncio.run(with_stub(tmp_path, body))
