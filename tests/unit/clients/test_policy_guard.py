"""The served-policy guard's rules (lorarl.client.rl.guard), with stand-in replicas and trainer: what it compares,
when it fires, how it names what a replica serves, and its metrics. The real replica is in
tests/integration/rollout/test_vllm_dense.py (each broken link of the serving path caught)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lorarl.client.job.config import PolicyGuardSection
from lorarl.client.rl.guard import PolicyGuard, PolicyGuardError, Probe
from lorarl.v1 import rollout_pb2, trainer_pb2

PROBE = Probe([1, 2, 3], [4, 5])
POLICY, BASE = [-1.0, -2.0], [-3.0, -3.0]


class Trainer:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    async def ComputeLogprobs(self, request):  # noqa: N802
        self.calls.append(request.reference)
        scores = BASE if request.reference else POLICY
        return trainer_pb2.ComputeLogprobsResponse(results=[trainer_pb2.TokenLogprobs(logprobs=scores)])


class Replica:
    def __init__(self, served: list[float]) -> None:
        self.served, self.requests = served, []

    async def Generate(self, request):  # noqa: N802
        self.requests.append(request)
        prompt = [float("nan"), -0.5, -0.5, *self.served]  # one logprob per token of prompt + completion
        return rollout_pb2.GenerateResponse(results=[rollout_pb2.PromptCompletions(prompt_logprobs=prompt)])


def run(guard: PolicyGuard, replicas: list, version: int = 2) -> list:
    async def body() -> list:
        await guard.expect(Trainer(), "job", version)
        return await guard.check(replicas, "job", version)

    return asyncio.run(body())


def test_a_replica_serving_the_trainers_version_passes_and_is_asked_pinned() -> None:
    replica = Replica([-1.01, -2.01])
    guard = PolicyGuard(PolicyGuardSection(), PROBE)
    [verdict] = run(guard, [("r0", replica)])
    assert verdict.diff == pytest.approx(0.01, abs=1e-6) and verdict.base_diff == pytest.approx(1.49, abs=1e-6)
    [request] = replica.requests
    assert list(request.prompts[0].token_ids) == [1, 2, 3, 4, 5] and request.sampling.prompt_logprobs
    assert (request.policy.job_id, request.policy.version) == ("job", 2)
    assert request.request_id == "job-policy-guard-v2"  # jobs sharing a rollout: ids of their own
    assert guard.metrics() == {"policy/guard_version": 2.0, "policy/guard_abs_diff": pytest.approx(0.01, abs=1e-6),
                               "policy/guard_alarm": 0.0}


def test_each_replica_is_checked_and_the_base_is_named() -> None:
    guard = PolicyGuard(PolicyGuardSection(), PROBE)
    with pytest.raises(PolicyGuardError, match=r"replica r1 serves version 2 .* it serves the base"):
        run(guard, [("r0", Replica(POLICY)), ("r1", Replica([-3.0, -2.99]))])
    with pytest.raises(PolicyGuardError, match="other weights than the trainer's"):
        run(PolicyGuard(PolicyGuardSection(), PROBE), [("r0", Replica([-0.2, -0.1]))])


def test_warn_flags_instead_of_failing(caplog: pytest.LogCaptureFixture) -> None:
    guard = PolicyGuard(PolicyGuardSection(action="warn", tolerance=0.1), PROBE)
    with caplog.at_level(logging.WARNING):
        run(guard, [("r0", Replica([-1.5, -2.0]))])
    assert "policy guard: replica r0 serves version 2" in caplog.text
    assert guard.metrics()["policy/guard_alarm"] == 1.0


def test_every_k_th_version_and_none_when_off() -> None:
    guard = PolicyGuard(PolicyGuardSection(every=2), PROBE)
    assert [v for v in range(6) if guard.due(v)] == [2, 4]
    assert run(guard, [("r0", Replica([0.0, 0.0]))], version=3) == []  # not due: nothing scored, nothing asked
    assert not PolicyGuard(PolicyGuardSection(every=0), PROBE).due(2)


def test_a_replica_that_serves_no_prompt_logprobs_turns_the_guard_off_once(caplog: pytest.LogCaptureFixture) -> None:
    import grpc

    from lorarl.client.calls import ServiceCallError

    class HfReplica:
        async def Generate(self, request):  # noqa: N802
            raise ServiceCallError("rollout", "", "Generate", grpc.StatusCode.FAILED_PRECONDITION,
                                   "sampling.prompt_logprobs: the HfEngine engine does not serve prompt logprobs")

    guard = PolicyGuard(PolicyGuardSection(), PROBE)
    with caplog.at_level(logging.WARNING):
        assert run(guard, [("r0", HfReplica())]) == []
    assert "policy guard off" in caplog.text and not guard.due(4)  # said once, then not asked again


def test_a_replica_that_does_not_serve_the_version_yet_is_not_probed_and_the_others_are() -> None:
    """A version that went live while a replica was away (weight sync restarted; the replica has not caught up):
    NOT_FOUND is no wrong weights, so that replica is left out of the check, not the run ended."""
    import grpc

    from lorarl.client.calls import ServiceCallError

    class Behind:
        async def Generate(self, request):  # noqa: N802
            raise ServiceCallError("rollout", "", "Generate", grpc.StatusCode.NOT_FOUND,
                                   "job v2 is not loaded (servable versions: [1])")

    guard = PolicyGuard(PolicyGuardSection(), PROBE)
    [verdict] = run(guard, [("behind", Behind()), ("r1", Replica(POLICY))])
    assert verdict.replica == "r1" and guard.metrics()["policy/guard_alarm"] == 0.0
