"""Full-model teachers on engines of their own (on-policy distillation, #47): the student's replica sends a teacher
that is not an adapter of its base to that teacher's engine (rollout.teacher_engines), on the transformers engine
here (two real rollout services on loopback, the second's address in the first's settings). The teacher is the
student's base with an adapter merged in, so the same teacher is also served as that adapter in the student's
engine: scored either way, the sampled tokens' teacher logprobs agree, and a mixture of the two is the same
distribution again."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.rollout.config import RolloutSettings
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import RolloutHarness, load_requests, merged_weights, save_checkpoint
from tests.unit.rollout.models import LORA, PROMPT, dense_model_dir, random_adapter

pytestmark = pytest.mark.slow

MERGED, ADAPTER = rollout_pb2.PolicySelector(engine="merged"), rollout_pb2.PolicySelector(job_id="expert")


@pytest.fixture(scope="module")
def student() -> Iterator[RolloutHarness]:
    model_dir = dense_model_dir()
    adapter = random_adapter(model_dir, seed=5)
    teacher_dir = save_checkpoint(model_dir, merged_weights(model_dir, adapter, LORA))
    teacher = RolloutHarness(RolloutSettings(model_path=str(teacher_dir), engine="hf", dtype="float32",
                                             max_model_len=256)).start()
    student = RolloutHarness(RolloutSettings(model_path=str(model_dir), engine="hf", dtype="float32", max_model_len=256,
                                             teacher_engines={"merged": teacher.running.address})).start()
    student.stub.LoadWeights(load_requests("expert", 1, adapter, common_pb2.SYNC_MODE_ADAPTER,
                                           base_model_fingerprint(model_dir), LORA))
    student.teacher = teacher  # type: ignore[attr-defined]
    yield student
    student.call(student.core.teacher_engines.close())
    student.close()
    teacher.close()


def scored(student: RolloutHarness, weights: list[float]) -> rollout_pb2.Completion:
    response = student.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT, teacher_weights=weights)], teachers=[MERGED, ADAPTER],
        sampling=common_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=8, seed=7)))
    assert response.teacher_seconds > 0
    return response.results[0].completions[0]


def read_logprobs(student: RolloutHarness, completion: list[int], policy: rollout_pb2.PolicySelector = ADAPTER
                  ) -> list[float]:
    """``policy``'s logprobs of ``completion`` after the prompt, read by the student's engine directly."""
    response = student.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=[*PROMPT, *completion])], policy=policy,
        sampling=common_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=True)))
    return list(response.results[0].prompt_logprobs)[len(PROMPT):]


@pytest.mark.parametrize("weights", [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], ids=["own-engine", "adapter", "mixture"])
def test_a_teacher_on_its_own_engine_scores_as_its_adapter_does(student: RolloutHarness, weights: list[float]) -> None:
    completion = scored(student, weights)
    tokens = list(completion.token_ids)
    assert len(tokens) == len(completion.teacher_logprobs) > 0
    assert list(completion.teacher_logprobs) == pytest.approx(read_logprobs(student, tokens), abs=1e-3)
    base = read_logprobs(student, tokens, rollout_pb2.PolicySelector())  # the teacher is not the student's base
    assert max(abs(a - b) for a, b in zip(base, completion.teacher_logprobs, strict=True)) > 0.05


def test_sampled_under_the_adapter_the_own_engine_teacher_gives_each_token_its_sampling_logprob(
        student: RolloutHarness) -> None:
    """Independent of how prompt logprobs are read: the student sampling under the adapter itself logs each token's
    logprob as it samples it (temperature 1, nothing cut), and the merged teacher on its own engine gives the same."""
    response = student.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT, teacher_weights=[1.0, 0.0])], teachers=[MERGED, ADAPTER],
        policy=ADAPTER, sampling=common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)))
    for completion in response.results[0].completions:
        assert list(completion.teacher_logprobs) == pytest.approx(list(completion.logprobs), abs=1e-3)


def test_an_engine_the_replica_does_not_know_and_an_engine_to_sample_from_are_refused(
        student: RolloutHarness) -> None:
    with pytest.raises(grpc.RpcError) as unknown:
        student.stub.Generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=PROMPT, teacher_weights=[1.0])],
            teachers=[rollout_pb2.PolicySelector(engine="elsewhere")],
            sampling=common_pb2.SamplingParams(max_tokens=2)))
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no teacher engine 'elsewhere'" in unknown.value.details() and "merged" in unknown.value.details()
    with pytest.raises(grpc.RpcError) as sampling:
        student.stub.Generate(rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], policy=MERGED,
                                                          sampling=common_pb2.SamplingParams(max_tokens=2)))
    assert sampling.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "only a teacher" in sampling.value.details()


def test_a_teacher_engine_that_refuses_or_is_gone_is_told_apart(student: RolloutHarness) -> None:
    """A token the teacher's engine refuses is permanent (FAILED_PRECONDITION, naming the engine): retrying or
    setting the student's replica aside would not help; an engine that is not there is UNAVAILABLE (retried)."""
    from lorarl.common.errors import FailedPreconditionError, UnavailableError
    from lorarl.common.ports import free_port
    from lorarl.rollout.schema import GenerateInput, PolicyRef
    from lorarl.rollout.teacher_engines import TeacherEngines
    from lorarl.rollout.teachers import SCORING

    rows = GenerateInput("r", (tuple(PROMPT),), SCORING, policy=PolicyRef(engine="merged"))

    async def call(address: str, token: str) -> None:
        engines = TeacherEngines({"merged": address}, token=token)
        try:
            await engines.generate(rows)
        finally:
            await engines.close()

    with pytest.raises(FailedPreconditionError, match=r"teacher engine 'merged' at .*UNAUTHENTICATED"):
        student.call(call(student.teacher.running.address, "not-the-token"))
    with pytest.raises(UnavailableError, match=r"teacher engine 'merged' at .*UNAVAILABLE"):
        student.call(call(f"127.0.0.1:{free_port('127.0.0.1')}", "rollout-test-token"))
