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

#: Tokens of scoring rows (prompt + completion) the engine is given at once, all teachers together. A scoring row
#: is a prefill whose every position's logits over the whole vocabulary are read, and vLLM computes a step's at once:
#: 16 rows of 88 tokens side by side raised the engine's peak by 0.43 GiB at the Qwen3-0.6B shape (152k tokens),
#: one row by 0.03. So the rows go in waves of this size (two such rows), each prefilled 32 tokens a step
#: (rollout.long_prefill_tokens, set by the launcher for a distilling job): the engine's peak stayed within 5% of
#: the same job's without teachers, in the same scoring time as all rows at once (bench/distill_memory.py).
WAVE_TOKENS = 192


def mixture(logprobs: Sequence[float], weights: Sequence[float]) -> float:
    """log sum_i w_i exp(lp_i) with the weights normalised (one teacher: its logprob exactly)."""
    total = sum(weights)
    terms = [math.log(w / total) + lp for lp, w in zip(logprobs, weights, strict=True) if w > 0]
    if len(terms) == 1:
        return logprobs[next(i for i, w in enumerate(weights) if w > 0)]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms)) if top > -math.inf else -math.inf


def waves(rows: list[list[tuple[int, int]]], tokens: Callable[[int, int], int], budget: int
          ) -> list[list[list[tuple[int, int]]]]:
    """``rows`` (per teacher, its (prompt, completion) rows) cut into waves of at most ``budget`` tokens, every
    teacher's rows together (a row longer than the budget is a wave of its own): each wave the teachers' batches
    side by side, the waves one after the other."""
    flat = sorted(((t, row) for t, teacher_rows in enumerate(rows) for row in teacher_rows),
                  key=lambda pair: (pair[1], pair[0]))  # in row order: a mixture's rows share a wave
    out: list[list[list[tuple[int, int]]]] = []
    used = budget
    for t, row in flat:
        size = tokens(*row)
        if used + size > budget:
            out.append([[] for _ in rows])
            used = 0
        out[-1][t].append(row)
        used += size
    return out


async def score(generate: Generate, request: GenerateInput, results: list[PromptResult],
                wave_tokens: int = WAVE_TOKENS) -> float:
    """Fills each scored completion's ``teacher_logprobs`` in place, the rows read in waves of at most
    ``wave_tokens`` tokens; returns the seconds it took."""
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

    async def read(t: int, teacher_rows: list[tuple[int, int]]) -> list[PromptResult]:
        if not teacher_rows:
            return []
        prompts = tuple(tuple(results[p].prompt_token_ids) + tuple(results[p].completions[c].token_ids)
                        for p, c in teacher_rows)
        return await generate(GenerateInput(request_id=f"{request.request_id}:teacher{t}", prompts=prompts,
                                            sampling=SCORING, policy=request.teachers[t]))

    per_row: dict[tuple[int, int], dict[int, list[float]]] = {}
    for wave in waves(rows, lambda p, c: len(results[p].prompt_token_ids) + len(results[p].completions[c].token_ids),
                      wave_tokens):
        scored = await asyncio.gather(*(read(t, wave_rows) for t, wave_rows in enumerate(wave)))
        for t, (teacher_rows, teacher_results) in enumerate(zip(wave, scored, strict=True)):
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
