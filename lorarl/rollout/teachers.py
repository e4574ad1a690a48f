"""Teachers score the student's completions in the student's own engine (on-policy distillation, #47).

A teacher is a policy this replica already serves: a LoRA adapter on the same base (loaded like any job's
version, in a slot beside the student's) or the base model itself. After the completions are sampled, each
teacher that any prompt routes to re-reads those prompts' completions as one batch of prefill-only requests
(prompt + completion as the prompt, its logprobs asked, one sampled token thrown away): no second engine, no
second copy of the base, no decode, and every teacher's batch runs concurrently so the engine batches them
together. A prompt's teacher logprob of a token is log sum_i w_i p_i(token) over its teachers' normalised
weights: a route (one weight) gives that teacher's logprob exactly, a mixture the weighted mixture's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence

from lorarl.rollout.schema import GenerateInput, PromptResult, Sampling

#: How a teacher re-reads a completion: its logprobs of the given tokens (raw, temperature 1), one token sampled.
SCORING = Sampling(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=True)

Generate = Callable[[GenerateInput], Awaitable[list[PromptResult]]]


def mixture(logprobs: Sequence[float], weights: Sequence[float]) -> float:
    """log sum_i w_i exp(lp_i) with the weights normalised (one teacher: its logprob exactly)."""
    total = sum(weights)
    terms = [math.log(w / total) + lp for lp, w in zip(logprobs, weights, strict=True) if w > 0]
    if len(terms) == 1:
        return logprobs[next(i for i, w in enumerate(weights) if w > 0)]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms)) if top > -math.inf else -math.inf


async def score(generate: Generate, request: GenerateInput, results: list[PromptResult]) -> float:
    """Fills each scored completion's ``teacher_logprobs`` in place; returns the seconds it took."""
    if not request.teachers:
        return 0.0
    start = time.perf_counter()
    # rows[t]: the (prompt, completion) pairs teacher t reads, in the order of its batch's prompts
    rows: list[list[tuple[int, int]]] = [[] for _ in request.teachers]
    for p, weights in enumerate(request.teacher_weights):
        for c, completion in enumerate(results[p].completions):
            if completion.token_ids:
                for t, w in enumerate(weights):
                    if w > 0:
                        rows[t].append((p, c))

    async def read(t: int) -> list[PromptResult]:
        if not rows[t]:
            return []
        prompts = tuple(tuple(results[p].prompt_token_ids) + tuple(results[p].completions[c].token_ids)
                        for p, c in rows[t])
        return await generate(GenerateInput(request_id=f"{request.request_id}:teacher{t}", prompts=prompts,
                                            sampling=SCORING, policy=request.teachers[t]))

    scored = await asyncio.gather(*(read(t) for t in range(len(request.teachers))))
    per_row: dict[tuple[int, int], dict[int, list[float]]] = {}
    for t, (teacher_rows, teacher_results) in enumerate(zip(rows, scored, strict=True)):
        for (p, c), result in zip(teacher_rows, teacher_results, strict=True):
            start_at = len(results[p].prompt_token_ids)
            logprobs = result.prompt_logprobs or []
            per_row.setdefault((p, c), {})[t] = logprobs[start_at:]
    for p, weights in enumerate(request.teacher_weights):
        for c, completion in enumerate(results[p].completions):
            if not weights:
                continue
            if not completion.token_ids:
                completion.teacher_logprobs = []
                continue
            by_teacher = per_row[(p, c)]
            chosen = sorted(by_teacher)
            completion.teacher_logprobs = [
                mixture([by_teacher[t][i] for t in chosen], [weights[t] for t in chosen])
                for i in range(len(completion.token_ids))]
    return time.perf_counter() - start
