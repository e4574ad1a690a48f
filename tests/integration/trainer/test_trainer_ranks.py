"""`lorarl serve trainer` with trainer.ranks=2: rank 0 serves gRPC and spawns rank 1; every engine call runs on
both in lockstep over gloo. Real processes on loopback: Megatron TP=2 and torch data parallel train what one rank
trains, checkpoints and exports work, PublishWeights reaches a real vLLM rollout, and a killed follower fails the
next call (and health) instead of hanging it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from lorarl.assets import DENSE_MODEL_DIR, MOE_MODEL_DIR
from lorarl.common.channel import sync_channel
from lorarl.common.ready import wait_for_ready_file
from lorarl.contract.routes import RoutedExperts
from lorarl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from tests.listeners import listening_addresses

TOKEN = "ranks-test-token"
PROMPT = [3, 7, 11, 13]
#: Compared between layouts: every value a step reports but its wall time.
KEYS = ("loss", "pg_loss", "entropy", "grad_norm", "clip_fraction", "ratio_mean", "tokens", "loss_tokens",
        "sequences", "version")
#: What the torch engine must share with Megatron on a first step (both adapters start as the identity).
FIRST_STEP_KEYS = ("loss", "pg_loss", "entropy", "clip_fraction", "ratio_mean", "tokens", "sequences")


@dataclass
class Trainer:
    process: subprocess.Popen[bytes]
    address: str
    channel: grpc.Channel
    stub: trainer_pb2_grpc.TrainerServiceStub

    def follower_pids(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.process.pid).children() if "lorarl.trainer.ranks.follower" in
                " ".join(c.cmdline())]

    def health(self) -> int:
        return health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def lorarl_command() -> list[str]:
    script = Path(sys.executable).with_name("lorarl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]


def start_trainer(workdir: Path, ranks: int, *sets: str) -> Trainer:
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / "ready.json"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORARL_")}, "LORARL_AUTH_TOKEN": TOKEN,
           "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [*lorarl_command(), "serve", "trainer", "--port", "0", "--metrics-port", "-1", "--ready-file", str(ready),
         "--set", f"trainer.ranks={ranks}", "--set", f"trainer.checkpoint_dir={workdir / 'ckpt'}",
         "--set", f"trainer.export_dir={workdir / 'export'}", "--set", "server.shutdown_grace_s=2", *sets],
        env=env, stdout=subprocess.DEVNULL, stderr=(workdir / "trainer.log").open("wb"))
    try:
        info = wait_for_ready_file(ready, timeout=90, process=process)
    except (RuntimeError, TimeoutError):
        process.kill()
        pytest.fail(f"trainer did not start:\n{(workdir / 'trainer.log').read_text()[-3000:]}")
    channel = sync_channel(info["address"], token=TOKEN)
    return Trainer(process, info["address"], channel, trainer_pb2_grpc.TrainerServiceStub(channel))


def stop_trainer(trainer: Trainer, timeout: float = 20) -> int:
    """SIGTERM; the exit code. Every follower must be gone with it."""
    followers = trainer.follower_pids() if trainer.process.poll() is None else []
    trainer.channel.close()
    trainer.process.send_signal(signal.SIGTERM)
    try:
        code = trainer.process.wait(timeout)
    except subprocess.TimeoutExpired:
        trainer.process.kill()
        trainer.process.wait()
        pytest.fail(f"trainer did not exit within {timeout} s of SIGTERM")
    for pid in followers:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    return code


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Trainer]]:
    """A 1-rank and a 2-rank trainer, shared by the comparisons (each test uses its own job ids)."""
    root = tmp_path_factory.mktemp("ranks")
    started: dict[int, Trainer] = {}
    try:
        for ranks in (1, 2):
            started[ranks] = start_trainer(root / f"ranks{ranks}", ranks)
        yield started
    finally:
        for trainer in started.values():
            assert stop_trainer(trainer) == 0


def config(engine: str = "torch", tp: int = 1, model: Path = DENSE_MODEL_DIR) -> trainer_pb2.JobConfig:
    # Adam's eps above fp32 rounding: a gradient that is 0 up to rounding (summed in another order under TP)
    # must not move a weight by lr * sign(g).
    cfg = trainer_pb2.JobConfig(base_model_path=str(model), lora=common_pb2.LoraSpec(rank=4, alpha=8), seed=1,
                                optimizer=trainer_pb2.OptimizerConfig(learning_rate=0.1, eps=1e-4,
                                                                      micro_batch_tokens=16),
                                engine=engine)
    if engine == "megatron":
        cfg.megatron.tensor_parallel_size = tp
    return cfg


def trajectory(completion: list[int], reward: float, group: str, version: int,
               prompt: list[int] = PROMPT) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(prompt_token_ids=prompt, completion_token_ids=completion,
                                 behavior_logprobs=[-2.0] * len(completion), token_versions=[version] * len(completion),
                                 reward=reward, group_id=group, finish_reason=common_pb2.FINISH_REASON_STOP)


def batch(version: int) -> list[common_pb2.Trajectory]:
    """Two groups of different lengths: two data-parallel ranks get one group each, with unequal token counts."""
    return [trajectory([21, 22, 23], 1.0, "g0", version), trajectory([40, 41, 42], 0.0, "g0", version),
            trajectory([50, 51], 1.0, "g1", version, [5, 9]), trajectory([60, 61, 62, 63, 64], 0.0, "g1", version,
                                                                         [5, 9])]


def values(response) -> dict[str, float]:
    return dict(response.metrics.values)


def assert_close(got: dict[str, float], want: dict[str, float], keys: tuple[str, ...], tol: float = 1e-5) -> None:
    for k in keys:
        assert got[k] == pytest.approx(want[k], abs=tol), (k, got[k], want[k])


def assert_same_tensors(a: Path, b: Path, tol: float = 1e-5) -> None:
    ta, tb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert ta.keys() == tb.keys() and ta
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], rtol=0, atol=tol, msg=name)


def train_save_resume_export(stub: trainer_pb2_grpc.TrainerServiceStub, job: str, cfg: trainer_pb2.JobConfig
                             ) -> tuple[list[dict[str, float]], list[list[float]], Path]:
    """Step, checkpoint, step, reload, the same step again (must repeat exactly), logprobs, adapter export."""
    created = stub.CreateJob(trainer_pb2.CreateJobRequest(job_id=job, config=cfg), timeout=120)
    assert created.job.config.engine == cfg.engine
    pushed = list(stub.PushTrajectories(iter([trainer_pb2.PushTrajectoriesRequest(job_id=job, trajectories=batch(0))]),
                                        timeout=60))
    assert pushed[0].accepted == 4
    first = stub.TrainStep(trainer_pb2.TrainStepRequest(job_id=job), timeout=120)
    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id=job), timeout=120)
    second = stub.TrainStep(trainer_pb2.TrainStepRequest(job_id=job, trajectories=batch(1)), timeout=120)
    loaded = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(job_id=job, path=saved.path), timeout=120)
    assert loaded.version == 1
    again = stub.TrainStep(trainer_pb2.TrainStepRequest(job_id=job, trajectories=batch(1)), timeout=120)
    assert values(again)["loss"] == values(second)["loss"] and again.version == 2
    logprobs = stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id=job, trajectories=batch(2)), timeout=60)
    exported = stub.Export(trainer_pb2.ExportRequest(job_id=job, mode=common_pb2.SYNC_MODE_ADAPTER), timeout=120)
    stub.DeleteJob(trainer_pb2.DeleteJobRequest(job_id=job), timeout=60)
    return [values(first), values(second)], [list(r.logprobs) for r in logprobs.results], Path(exported.path)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_megatron_tp2_over_two_ranks_trains_what_tp1_trains(services: dict[int, Trainer]) -> None:
    tp2, tp2_logprobs, tp2_export = train_save_resume_export(services[2].stub, "mtp2", config("megatron", tp=2))
    tp1, tp1_logprobs, tp1_export = train_save_resume_export(services[1].stub, "mtp1", config("megatron", tp=1))
    torch1, _, _ = train_save_resume_export(services[1].stub, "torch-ref", config("torch"))
    for got, want in zip(tp2, tp1, strict=True):
        assert_close(got, want, KEYS)
    assert_close(tp2[0], torch1[0], FIRST_STEP_KEYS)  # same model, identity adapters: the engines agree
    assert tp2[1]["loss"] != tp2[0]["loss"]  # the step changed the policy, so the comparisons can fail
    for a, b in zip(tp2_logprobs, tp1_logprobs, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)  # fp32: ~-17 nats carry 1e-6 relative rounding
    assert_same_tensors(tp2_export, tp1_export)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torch_engine_over_two_ranks_is_data_parallel(services: dict[int, Trainer]) -> None:
    two, two_logprobs, two_export = train_save_resume_export(services[2].stub, "dp2", config("torch"))
    one, one_logprobs, one_export = train_save_resume_export(services[1].stub, "dp1", config("torch"))
    for got, want in zip(two, one, strict=True):
        assert_close(got, want, (*KEYS, "lr", "step"))
    for a, b in zip(two_logprobs, one_logprobs, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)  # fp32: ~-17 nats carry 1e-6 relative rounding
    assert_same_tensors(two_export, one_export)
    assert any(t.abs().max() > 1e-3 for n, t in load_file(two_export / "adapter_model.safetensors").items()
               if "lora_B" in n)  # the adapters moved


def routed_batch(seed: int) -> list[common_pb2.Trajectory]:
    """`batch(0)` with routes for the shipped tiny MoE (4 MoE layers, top-2 of 8): random experts, so they part
    from the live routing, and one record's last positions not recorded (-1)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i, t in enumerate(batch(0)):
        positions = len(t.prompt_token_ids) + len(t.completion_token_ids) - 1
        ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(positions * 4)])
        ids = ids.reshape(positions, 4, 2).to(torch.int16).numpy()
        if i == 3:
            ids[-2:] = -1
        t.routed_experts.CopyFrom(RoutedExperts(ids, 8).to_proto())
        out.append(t)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["megatron", "torch"])
def test_a_two_rank_trainer_replays_routes_as_one_rank_does(services: dict[int, Trainer], engine: str) -> None:
    """Routing replay (R3) through the rank group: a MoE job with routing_replay 'on' over two ranks (Megatron:
    TP 2; torch: data parallel, one group per rank) takes routed trajectories and computes what one rank
    computes: routes travel to the follower with the records, and the routing figures count every rank's share
    (rank 0's alone would be about half)."""
    results = {}
    for ranks in (2, 1):
        stub, job = services[ranks].stub, f"r3-{engine}-{ranks}"
        cfg = config(engine, tp=ranks, model=MOE_MODEL_DIR)
        cfg.routing_replay = "on"
        stub.CreateJob(trainer_pb2.CreateJobRequest(job_id=job, config=cfg), timeout=120)
        step = stub.TrainStep(trainer_pb2.TrainStepRequest(job_id=job, trajectories=routed_batch(0)), timeout=120)
        results[ranks] = values(step)
        stub.DeleteJob(trainer_pb2.DeleteJobRequest(job_id=job), timeout=60)
    assert results[2]["routing_replayed_fraction"] < 1.0 and results[2]["routing_token_disagreement"] > 0.3
    assert_close(results[2], results[1], (*FIRST_STEP_KEYS, "routing_replayed_fraction", "routing_disagreement",
                                          "routing_token_disagreement", "routing_replayed_tokens"))


@pytest.mark.slow
def test_parallel_sizes_that_do_not_fit_the_ranks_are_refused(services: dict[int, Trainer]) -> None:
    stub = services[2].stub
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateJob(trainer_pb2.CreateJobRequest(job_id="tp3", config=config("megatron", tp=3)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.megatron.tensor_parallel_size" in err.value.details() and "2 ranks" in err.value.details()
    bad_device = config("torch")
    bad_device.device = "cuda:1"
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateJob(trainer_pb2.CreateJobRequest(job_id="dev", config=bad_device), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "config.device" in err.value.details()
    assert services[2].health() == health_pb2.HealthCheckResponse.SERVING  # refusals leave the ranks healthy


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_idle_followers_stay_in_touch_and_a_killed_one_fails_the_next_call_clearly(tmp_path: Path) -> None:
    timeout_s = 20  # one collective's bound; rank 0 pings idle followers every timeout / 4
    trainer = start_trainer(tmp_path, 2, "--set", f"trainer.rank_timeout_s={timeout_s}")
    try:
        (follower,) = trainer.follower_pids()
        time.sleep(timeout_s + 2)  # longer than a follower may wait for a command: only the pings keep it
        trainer.stub.CreateJob(trainer_pb2.CreateJobRequest(job_id="alive", config=config("torch")), timeout=60)
        assert trainer.health() == health_pb2.HealthCheckResponse.SERVING
        os.kill(follower, signal.SIGKILL)
        eventually(lambda: trainer.health() == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            trainer.stub.CreateJob(trainer_pb2.CreateJobRequest(job_id="j", config=config("torch")), timeout=30)
        assert time.monotonic() - started < 20  # at once, not after the call's 30 s timeout
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"trainer rank 1 (pid {follower}) exited with signal SIGKILL" in err.value.details()
    finally:
        assert stop_trainer(trainer) == 0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_publish_from_two_ranks_reaches_a_vllm_rollout_with_the_trainers_logprobs(tmp_path: Path) -> None:
    from lorarl.client.launch.local import LocalStack

    sections = {
        "weightsync": {"storage_dir": str(tmp_path / "ws"), "collective_backend": "gloo"},
        "trainer": {"ranks": 2, "checkpoint_dir": str(tmp_path / "ckpt"), "export_dir": str(tmp_path / "export")},
        "rollout": {"model_path": str(DENSE_MODEL_DIR), "engine": "vllm", "dtype": "float32", "max_lora_rank": 8,
                    "max_loras": 2, "adapter_window": 2, "replica_id": "rollout-0", "collective_backends": ["gloo"]},
    }
    with LocalStack(tmp_path / "services", sections, start_timeout_s=180) as stack:
        trainer = trainer_pb2_grpc.TrainerServiceStub(sync_channel(stack.address("trainer"), token=stack.token))
        rollout = rollout_pb2_grpc.RolloutServiceStub(sync_channel(stack.address("rollout"), token=stack.token))
        trainer.CreateJob(trainer_pb2.CreateJobRequest(job_id="pub", config=config("megatron", tp=2)), timeout=120)
        trainer.TrainStep(trainer_pb2.TrainStepRequest(job_id="pub", trajectories=batch(0)), timeout=120)
        published = trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(
            job_id="pub", mode=common_pb2.SYNC_MODE_ADAPTER, wait_for_activation=True, timeout_seconds=120),
            timeout=180)
        assert published.activated, published.error
        assert published.version == 1 and published.transport == "collective"
        # Every service binds 127.0.0.1, and so does everything it started: the trainer ranks' rendezvous
        # store, the transfer group's store and gloo pairs, the rollout's engine (nothing on * or 0.0.0.0).
        for svc in stack.processes.values():
            wide = {a for a in listening_addresses(svc.process.pid) if a[0] != "127.0.0.1"}
            assert not wide, (svc.name, wide)
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [[257, 10, 55, 43, 52, 258, 10, 257, 9], [257, 40, 41, 42, 43, 44]]
        response = rollout.Generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts], sampling=sampling,
            policy=rollout_pb2.PolicySelector(job_id="pub", version=1)), timeout=120)
        completions = [r.completions[0] for r in response.results]
        assert all(list(c.token_versions) == [1] * len(c.token_ids) for c in completions)
        records = [common_pb2.Trajectory(prompt_token_ids=p, completion_token_ids=c.token_ids,
                                         behavior_logprobs=c.logprobs, token_versions=c.token_versions)
                   for p, c in zip(prompts, completions, strict=True)]
        mine = trainer.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="pub", trajectories=records),
                                       timeout=60)
        base = trainer.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(job_id="pub", trajectories=records,
                                                                          reference=True), timeout=60)
        for c, lp in zip(completions, mine.results, strict=True):
            assert list(c.logprobs) == pytest.approx(list(lp.logprobs), abs=1e-4)
        assert max(abs(a - b) for lp, ref in zip(mine.results, base.results, strict=True)
                   for a, b in zip(lp.logprobs, ref.logprobs, strict=True)) > 1e-3  # the adapter matters
