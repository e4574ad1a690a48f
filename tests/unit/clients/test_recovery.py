"""The recovery rule, its budget, named service errors, the health wait, the run log's rewind, and the
loop carrying on from a resume point after a fault (against the loop's in-process stand-in stubs; the
real services die and come back in tests/e2e/test_faults.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from lorarl.client.calls import NamedStub, ServiceCallError
from lorarl.client.job.config import load_job_config
from lorarl.client.job.datasets import Example
from lorarl.client.rl import recovery
from lorarl.client.rl.loop import LoopState, RLLoop
from lorarl.client.rl.recovery import (
    ActivationFailedError,
    RecoveryBudget,
    RecoveryExhaustedError,
    recoverable,
    wait_serving,
)
from lorarl.client.rl.run_log import RunLog
from lorarl.common.ports import free_port
from lorarl.common.server import start_server
from lorarl.common.server_config import ServerConfig
from lorarl.v1 import rollout_pb2, trainer_pb2, trainer_pb2_grpc
from tests.unit.clients.test_loop_async import ROOT, Recorder


def failure(service: str, code: grpc.StatusCode) -> ServiceCallError:
    return ServiceCallError(service, "127.0.0.1:1", "TrainStep", code, "details")




def test_restarts_are_waited_out_and_bad_requests_are_not() -> None:
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED):
        assert recoverable(failure("rollout", code))
    assert recoverable(failure("trainer", grpc.StatusCode.NOT_FOUND))  # a restarted trainer lost the job
    assert not recoverable(failure("weightsync", grpc.StatusCode.NOT_FOUND))
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL,
                 grpc.StatusCode.FAILED_PRECONDITION):
        assert not recoverable(failure("trainer", code))
    assert recoverable(ActivationFailedError("v3 was not activated"))
    assert not recoverable(RuntimeError("a bug"))


def test_the_budget_backs_off_and_runs_out() -> None:
    budget = RecoveryBudget(max_recoveries=3, wait_s=10)
    error = failure("trainer", grpc.StatusCode.UNAVAILABLE)
    assert [budget.spend(error) for _ in range(3)] == [1.0, 2.0, 4.0]
    with pytest.raises(RecoveryExhaustedError, match=r"after 3 recoveries.*TrainStep"):
        budget.spend(error)


def test_a_failed_call_names_the_service_the_call_and_what_to_do() -> None:
    async def body() -> None:
        address = f"127.0.0.1:{free_port()}"  # nothing listens there
        async with grpc.aio.insecure_channel(address) as channel:
            stub = NamedStub(trainer_pb2_grpc.TrainerServiceStub(channel), "trainer", address)
            with pytest.raises(ServiceCallError) as unary:
                await stub.GetJob(trainer_pb2.GetJobRequest(job_id="demo"), timeout=5)
            assert unary.value.code == grpc.StatusCode.UNAVAILABLE
            message = str(unary.value)
            assert message.startswith(f"trainer at {address}: GetJob failed with UNAVAILABLE")
            assert "restarting" in message and "\n" not in message

            async def requests():
                yield trainer_pb2.PushTrajectoriesRequest(job_id="demo")

            with pytest.raises(ServiceCallError, match="PushTrajectories failed with UNAVAILABLE"):
                async for _ in stub.PushTrajectories(requests(), timeout=5):
                    pass

    asyncio.run(body())


def test_the_health_wait_returns_once_serving_and_names_who_did_not_come_back() -> None:
    async def body() -> None:
        config = ServerConfig(port=0)
        config.auth.required = False
        running = await start_server("probe", config, lambda server: [])
        dead = f"127.0.0.1:{free_port()}"
        try:
            async with grpc.aio.insecure_channel(running.address) as up, grpc.aio.insecure_channel(dead) as down:
                await wait_serving({"trainer": up}, timeout_s=5)
                with pytest.raises(RecoveryExhaustedError, match=f"rollout at {dead} did not come back within 1 s"):
                    await wait_serving({"trainer": up, f"rollout at {dead}": down}, timeout_s=1)

                def supervisor_gave_up() -> None:
                    raise RuntimeError("the rollout service was restarted 5 times already")

                with pytest.raises(RuntimeError, match="restarted 5 times"):
                    await wait_serving({"rollout": down}, timeout_s=30, give_up=supervisor_gave_up)
        finally:
            await running.stop(0)

    asyncio.run(body())


def test_rewinding_the_run_log_keeps_each_step_once(tmp_path: Path) -> None:
    log = RunLog(tmp_path, total_steps=5, tensorboard=False, progress=False)
    log({"step": 0.0, "eval/accuracy": 0.1})
    for step in (1, 2, 3):
        log({"step": float(step), "rollout/reward_mean": float("nan") if step == 2 else 0.5})
    log.rewind(2)  # steps after the resume point at 2 are redone
    log({"step": 3.0, "rollout/reward_mean": 0.7})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["rollout/reward_mean"] == 0.7 and rows[2]["rollout/reward_mean"] is None
    again = RunLog(tmp_path, total_steps=5, tensorboard=False, progress=False)
    again.rewind(-1)  # a fresh run in the same directory starts clean
    again.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


class Flaky(Recorder):
    """The stand-in services, whose rollout is unreachable for batch ``fail_at``'s first ``times`` tries."""

    def __init__(self, fail_at: int, times: int = 1) -> None:
        super().__init__(generate_s=0.01, train_s=0.01)
        self.fail_at, self.times = fail_at, times

    async def Generate(self, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:  # noqa: N802
        if f"-b{self.fail_at}-p0-" in request.request_id and self.times:  # the batch's first episode
            self.times -= 1
            raise ServiceCallError("rollout", "127.0.0.1:2", "Generate", grpc.StatusCode.UNAVAILABLE, "reset")
        return await super().Generate(request)


def flaky_loop(stub: Flaky, mode: str, max_recoveries: int = 10) -> tuple[RLLoop, list[int], list[int]]:
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"),
                          ["loop.steps=6", "loop.prompts_per_step=2", "rollout.group_size=2", "loop.eval_every=0",
                           f"loop.mode={mode}", "loop.max_staleness=1", f"recovery.max_recoveries={max_recoveries}",
                           "loop.policy_guard.every=0"])  # stub services: the guard has its own tests
    examples = [Example(f"q{i}", "1") for i in range(8)]
    saved: list[int] = []
    rewinds: list[int] = []

    async def checkpoint(state: LoopState, name: str) -> None:
        saved.append(state.step)

    async def recover() -> LoopState:
        step = saved[-1]  # the last resume point; the stand-in trainer kept its version: continue above it
        return LoopState(step=step, version=stub.version, cursor=step * 2, version_base=stub.trained - step)

    loop = RLLoop(cfg, trainer=stub, rollout=stub, reward=lambda text, answer: float(text == answer),
                  train=examples, test=examples[:2], on_metrics=lambda row: None, on_checkpoint=checkpoint,
                  recover=recover, on_rewind=rewinds.append)
    asyncio.run(asyncio.wait_for(loop.run(), timeout=30))
    return loop, saved, rewinds


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_loop_carries_on_from_its_resume_point_after_a_fault(mode: str, monkeypatch) -> None:
    monkeypatch.setattr(recovery, "BACKOFF_MIN_S", 0.01)
    stub = Flaky(fail_at=3)
    loop, saved, rewinds = flaky_loop(stub, mode)
    assert loop.state.step == 6 and rewinds == [3] and loop.budget.used == 1
    assert saved[:3] == [1, 2, 3]  # a resume point after every step (recovery.resume_every=1)
    trained = [b for what, b, _ in stub.events if what == "train-start"]
    assert trained == sorted(trained) and len(trained) == 6  # no step trained twice: the fault came first
    generated = [b for what, b, _ in stub.events if what == "generate-start"]
    assert generated.count(3) == 1 and 5 in generated  # batch 3 generated again once the rollout answered


def test_the_loop_gives_up_when_the_budget_is_spent(monkeypatch) -> None:
    monkeypatch.setattr(recovery, "BACKOFF_MIN_S", 0.01)
    with pytest.raises(RecoveryExhaustedError, match=r"after 2 recoveries.*Generate failed with UNAVAILABLE"):
        flaky_loop(Flaky(fail_at=2, times=100), "sync", max_recoveries=2)


def test_a_run_healthy_for_healthy_steps_starts_its_fault_count_and_pause_again() -> None:
    from lorarl.client.rl.recovery import RecoveryBudget, RecoveryExhaustedError

    budget = RecoveryBudget(max_recoveries=3, wait_s=1.0, healthy_steps=20)
    pauses = [budget.spend(RuntimeError("x")) for _ in range(3)]
    assert pauses == sorted(pauses) and pauses[0] < pauses[-1]  # a growing pause
    budget.recovered(100)
    assert not budget.progress(119) and budget.used == 3  # not yet healthy
    assert budget.progress(120) and budget.used == 0
    assert budget.spend(RuntimeError("y")) == pauses[0]  # the pause starts over too
    # a fault every few steps still ends the run
    budget.recovered(121)
    for step in (122, 125):
        assert not budget.progress(step)
        budget.spend(RuntimeError("z"))
        budget.recovered(step)
    with pytest.raises(RecoveryExhaustedError):
        budget.spend(RuntimeError("again"))
    # healthy_steps 0: the count is for the whole run
    whole = RecoveryBudget(max_recoveries=2, wait_s=1.0)
    whole.spend(RuntimeError("a"))
    whole.recovered(0)
    assert not whole.progress(10_000) and whole.used == 1
