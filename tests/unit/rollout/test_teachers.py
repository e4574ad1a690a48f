"""Teachers scoring the student's completions (lorarl.rollout.teachers): which rows each teacher reads, in one
batch per teacher with the teachers side by side; a route gives its teacher's logprobs exactly, a mixture the
weighted log-sum-exp; and what Generate's validation refuses."""

from __future__ import annotations

import asyncio
import math

import pytest

from lorarl.common.errors import InvalidArgumentError
from lorarl.rollout.schema import Completion, GenerateInput, PolicyRef, PromptResult, Sampling
from lorarl.rollout.teachers import SCORING, mixture, score
from lorarl.rollout.validation import MAX_TEACHERS, Limits, generate_input
from lorarl.v1 import common_pb2, rollout_pb2

TEACHERS = (PolicyRef("sort-expert", 1), PolicyRef("tools-expert", 2))


def teacher_logprob(teacher: str, position: int, token: int) -> float:
    """A teacher's made-up logprob of ``token`` at ``position`` (distinct per teacher)."""
    return -0.1 * (1 + position) - 0.01 * token - (0.5 if teacher == "tools-expert" else 0.0)


class Teachers:
    """Serves scoring requests as an engine would: the prompt's logprobs under the request's policy."""

    def __init__(self) -> None:
        self.requests: list[GenerateInput] = []
        self.in_flight = self.most_in_flight = 0

    async def generate(self, request: GenerateInput) -> list[PromptResult]:
        self.requests.append(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return [PromptResult(list(p), [Completion([7])], [math.nan] + [
            teacher_logprob(request.policy.job_id, i, t) for i, t in enumerate(p) if i > 0]) for p in request.prompts]


def results(prompts: list[list[int]], completions: list[list[list[int]]]) -> list[PromptResult]:
    return [PromptResult(p, [Completion(token_ids=c) for c in cs]) for p, cs in zip(prompts, completions, strict=True)]


def test_each_prompt_is_scored_by_its_teachers_in_one_batch_per_teacher() -> None:
    prompts = [[1, 2], [3, 4, 5], [6], [8]]
    out = results(prompts, [[[10, 11], [12]], [[13]], [[14, 15, 16]], [[17]]])
    weights = ((1.0, 0.0), (0.0, 2.0), (0.25, 0.75), ())  # a route, a route (any positive weight), a mixture, none
    request = GenerateInput("req", tuple(map(tuple, prompts)), Sampling(), teachers=TEACHERS, teacher_weights=weights)
    engine = Teachers()
    seconds = asyncio.run(score(engine.generate, request, out))
    assert seconds > 0 and engine.most_in_flight == 2  # the teachers' batches run side by side
    assert sorted((r.policy.job_id, len(r.prompts)) for r in engine.requests) == [("sort-expert", 3),
                                                                                 ("tools-expert", 2)]
    assert all(r.sampling == SCORING and r.request_id.startswith("req:teacher") for r in engine.requests)
    # a prompt's rows are prompt + completion as the teacher's prompt
    assert (1, 2, 10, 11) in next(r for r in engine.requests if r.policy.job_id == "sort-expert").prompts

    def own(teacher: str, prompt: list[int], completion: list[int]) -> list[float]:
        return [teacher_logprob(teacher, len(prompt) + j, t) for j, t in enumerate(completion)]

    assert out[0].completions[0].teacher_logprobs == own("sort-expert", [1, 2], [10, 11])  # exactly its own
    assert out[0].completions[1].teacher_logprobs == own("sort-expert", [1, 2], [12])
    assert out[1].completions[0].teacher_logprobs == own("tools-expert", [3, 4, 5], [13])
    mixed = [math.log(0.25 * math.exp(a) + 0.75 * math.exp(b))
             for a, b in zip(own("sort-expert", [6], [14, 15, 16]), own("tools-expert", [6], [14, 15, 16]),
                             strict=True)]
    assert out[2].completions[0].teacher_logprobs == pytest.approx(mixed, abs=1e-12)
    assert out[3].completions[0].teacher_logprobs is None  # not scored


def test_rows_are_read_in_waves_of_a_token_budget_with_the_same_logprobs() -> None:
    """Many rows: each wave's rows (every teacher's) stay within the budget, teachers side by side in a wave, and
    the logprobs are those of one wave."""
    prompts = [[p, p + 1] for p in range(1, 9)]
    completions = [[[20 + p, 21 + p, 22 + p], [30 + p]] for p in range(8)]
    weights = tuple((1.0, 0.0) if p % 2 else (0.5, 0.5) for p in range(8))
    request = GenerateInput("req", tuple(map(tuple, prompts)), Sampling(), teachers=TEACHERS, teacher_weights=weights)

    class Counting(Teachers):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = self.most_tokens = 0

        async def generate(self, request: GenerateInput) -> list[PromptResult]:
            size = sum(map(len, request.prompts))
            self.tokens += size
            self.most_tokens = max(self.most_tokens, self.tokens)
            try:
                return await super().generate(request)
            finally:
                self.tokens -= size

    whole, waved = results(prompts, completions), results(prompts, completions)
    asyncio.run(score(Teachers().generate, request, whole))
    engine = Counting()
    asyncio.run(score(engine.generate, request, waved, wave_tokens=12))
    assert engine.most_tokens <= 12 and len(engine.requests) > 2 and engine.most_in_flight == 2
    assert [[c.teacher_logprobs for c in r.completions] for r in waved] == \
        [[c.teacher_logprobs for c in r.completions] for r in whole]


def test_a_request_without_teachers_scores_nothing_and_an_empty_completion_reads_nothing() -> None:
    engine = Teachers()
    out = results([[1]], [[[]]])
    assert asyncio.run(score(engine.generate, GenerateInput("r", ((1,),), Sampling()), out)) == 0.0
    request = GenerateInput("r", ((1,),), Sampling(), teachers=TEACHERS[:1], teacher_weights=((1.0,),))
    asyncio.run(score(engine.generate, request, out))
    assert engine.requests == [] and out[0].completions[0].teacher_logprobs == []


def test_mixture_is_a_weighted_log_sum_exp() -> None:
    assert mixture([-1.0, -2.0], [1.0, 0.0]) == -1.0
    assert mixture([-1.0, -2.0], [1.0, 1.0]) == pytest.approx(math.log((math.exp(-1) + math.exp(-2)) / 2))
    assert mixture([-1.0, -math.inf], [1.0, 3.0]) == pytest.approx(math.log(0.25) - 1.0)


LIMITS = Limits(vocab_size=100, max_model_len=32, max_n=8, max_logprobs=5, default_max_tokens=16)


def request(weights: list[list[float]], teachers: int = 2, **sampling: object) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=[1, 2, 3], teacher_weights=w) for w in weights],
        sampling=common_pb2.SamplingParams(**{"max_tokens": 8, **sampling}),
        teachers=[rollout_pb2.PolicySelector(job_id=f"t{i}", version=1) for i in range(teachers)])


@pytest.mark.parametrize(("bad", "field", "words"), [
    (request([[1.0]]), "prompts[0].teacher_weights", "has 1 entries for 2 teachers"),
    (request([[1.0, -1.0]]), "prompts[0].teacher_weights", "finite and >= 0"),
    (request([[0.0, 0.0]]), "prompts[0].teacher_weights", "are all 0"),
    (request([[1.0]], teachers=0), "prompts[0].teacher_weights", "names no teachers"),
    (request([], teachers=MAX_TEACHERS + 1), "teachers", f"at most {MAX_TEACHERS}"),
    (request([[1.0, 0.0]], prompt_logprobs=True), "sampling.prompt_logprobs", "not served together with teachers"),
    (request([[1.0, 0.0]], max_tokens=29), "sampling.max_tokens", "the 1 position teachers read"),
])
def test_generate_refuses_teacher_weights_that_cannot_be_scored(bad: rollout_pb2.GenerateRequest, field: str,
                                                                words: str) -> None:
    if not bad.prompts:
        bad.prompts.add(token_ids=[1])
    with pytest.raises(InvalidArgumentError) as refused:
        generate_input(bad, LIMITS, None)
    assert refused.value.field == field and words in str(refused.value)


def test_generate_reads_teachers_and_weights_and_keeps_one_position_for_them() -> None:
    got = generate_input(request([[1.0, 0.0], [], [0.5, 0.5]], max_tokens=0), LIMITS, None)
    assert got.teachers == (PolicyRef("t0", 1), PolicyRef("t1", 1))
    assert got.teacher_weights == ((1.0, 0.0), (), (0.5, 0.5))
    assert got.sampling.max_tokens == 16  # default, within 32 - 3 - 1
    assert generate_input(request([[1.0, 0.0]], max_tokens=28), LIMITS, None).sampling.max_tokens == 28
