"""Evaluation of a policy on a task split with transformers: greedy accuracy and pass@k by sampling.

A policy is given either as a transformers causal LM (decoded here, batched, left-padded) or as any
``generate(prompts) -> completions`` callable, so the same helper scores a vLLM engine or a service.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lorarl.assets.paths import TOKENIZER_DIR
from lorarl.assets.tasks import Problem, exact_reward, load_split
from lorarl.assets.tokenizer import default_tokenizer, prompt_token_ids

MAX_NEW_TOKENS = 8
"""Answers are at most five digits plus end of turn; longer completions are wrong anyway."""

GenerateFn = Callable[[Sequence[str]], Sequence[str]]


@dataclass(frozen=True)
class EvalResult:
    """Accuracy on a list of problems, with the completions that earned it."""

    accuracy: float
    completions: list[str]
    per_task: dict[str, float]


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos}


def _problems(split: str | Sequence[Problem], limit: int | None) -> list[Problem]:
    return list(load_split(split) if isinstance(split, str) else split)[:limit]


@torch.inference_mode()
def generate_token_ids(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int = MAX_NEW_TOKENS,
    temperature: float = 0.0,
    batch_size: int = 256,
    seed: int | None = None,
) -> list[list[int]]:
    """Completion token ids (end of turn included when produced) for chat-formatted prompt ids.

    ``temperature == 0`` is greedy; otherwise pure sampling at that temperature (no top-k/top-p).
    """
    eos_ids = _eos_ids(model)
    pad_id = model.generation_config.pad_token_id
    if temperature == 0:
        sampling: dict[str, Any] = {"do_sample": False}
    else:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    if seed is not None:
        torch.manual_seed(seed)
    out: list[list[int]] = []
    for start in range(0, len(prompt_ids), batch_size):
        ids, mask = _left_pad(prompt_ids[start : start + batch_size], pad_id)
        generated = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos_ids),
            pad_token_id=pad_id,
            **sampling,
        )
        for row in generated[:, ids.shape[1] :].tolist():
            end = next((i for i, token in enumerate(row) if token in eos_ids), None)
            out.append(row if end is None else row[: end + 1])
    return out


def model_generate_fn(
    model: Any, tokenizer: Any | None = None, temperature: float = 0.0, seed: int | None = None
) -> GenerateFn:
    """Wrap a transformers model as ``generate(prompts) -> completion texts``."""
    tokenizer = tokenizer or default_tokenizer()

    def generate(prompts: Sequence[str]) -> list[str]:
        ids = [prompt_token_ids(tokenizer, p) for p in prompts]
        completions = generate_token_ids(model, ids, temperature=temperature, seed=seed)
        return [tokenizer.decode(c, skip_special_tokens=True) for c in completions]

    return generate


def _score(problems: Sequence[Problem], completions: Sequence[str]) -> EvalResult:
    rewards = [exact_reward(c, p.answer) for c, p in zip(completions, problems, strict=True)]
    per_task: dict[str, list[float]] = {}
    for problem, reward in zip(problems, rewards, strict=True):
        per_task.setdefault(problem.task, []).append(reward)
    return EvalResult(
        accuracy=sum(rewards) / max(len(rewards), 1),
        completions=list(completions),
        per_task={task: sum(r) / len(r) for task, r in sorted(per_task.items())},
    )


def evaluate_greedy(
    policy: Any | GenerateFn, split: str | Sequence[Problem] = "test", limit: int | None = None
) -> EvalResult:
    """Greedy exact-match accuracy of ``policy`` (a transformers model or a generate callable)
    on a split name or an explicit list of problems (the first ``limit`` of them if given)."""
    problems = _problems(split, limit)
    generate = policy if not isinstance(policy, torch.nn.Module) else model_generate_fn(policy)
    return _score(problems, list(generate([p.prompt for p in problems])))


def pass_at_k(
    model: Any,
    split: str | Sequence[Problem] = "test",
    k: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
    limit: int | None = None,
) -> dict[str, float]:
    """Fraction of problems with at least one right answer among ``k`` samples, plus the mean
    per-sample accuracy (what a policy-gradient step sees as its success rate)."""
    problems = _problems(split, limit)
    tokenizer = default_tokenizer()
    ids = [prompt_token_ids(tokenizer, p.prompt) for p in problems for _ in range(k)]
    completions = generate_token_ids(model, ids, temperature=temperature, seed=seed)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    ended = [bool(c) and c[-1] in _eos_ids(model) for c in completions]
    hits = [exact_reward(t, problems[i // k].answer) for i, t in enumerate(texts)]
    solved = [max(hits[i * k : (i + 1) * k]) for i in range(len(problems))]
    per_task: dict[str, list[float]] = {}
    for problem, hit in zip(problems, solved, strict=True):
        per_task.setdefault(problem.task, []).append(hit)
    return {
        f"pass@{k}": sum(solved) / max(len(solved), 1),
        **{f"pass@{k}/{task}": sum(v) / len(v) for task, v in sorted(per_task.items())},
        "sample_accuracy": sum(hits) / max(len(hits), 1),
        "eos_rate": sum(ended) / max(len(ended), 1),
    }


@torch.inference_mode()
def evaluate_tool_greedy(model: Any, problems: Sequence[Any], batch_size: int = 100) -> dict[str, float]:
    """The tool task's episodes decoded greedily, as the agent workflow runs them: turn 1; if it calls the
    calculator, its result follows and turn 2 answers. Success rate, call rate, and misreads among calls."""
    from lorarl.assets.tool_task import TOOLS, calculate, final_answer
    from lorarl.contract.chat import ChatRenderer
    from lorarl.contract.tool_calls import parse_tool_calls

    tokenizer = default_tokenizer()
    renderer = ChatRenderer(str(TOKENIZER_DIR))
    prompts = [renderer.render([{"role": "user", "content": p.prompt}], tools=TOOLS) for p in problems]
    first = generate_token_ids(model, prompts, max_new_tokens=96, batch_size=batch_size)
    answers: list[str | None] = []
    calls, follow_prompts, follow_index = 0, [], []
    for i, (prompt, turn) in enumerate(zip(prompts, first, strict=True)):
        _, tool_calls = parse_tool_calls(tokenizer.decode(turn, skip_special_tokens=True))
        if not tool_calls:
            answers.append(final_answer(tokenizer.decode(turn, skip_special_tokens=True)))
            continue
        calls += 1
        result = calculate(json.loads(tool_calls[0]["function"]["arguments"]).get("expr", ""))
        ended = turn if turn[-1:] == [renderer.end_of_turn_id] else [*turn, renderer.end_of_turn_id]
        follow_prompts.append([*prompt, *ended, *renderer.render_followup(
            [{"role": "tool", "tool_call_id": "call_0", "content": result}], tools=TOOLS)])
        follow_index.append(i)
        answers.append(None)
    for i, turn in zip(follow_index, generate_token_ids(model, follow_prompts, max_new_tokens=12,
                                                        batch_size=batch_size), strict=True):
        answers[i] = final_answer(tokenizer.decode(turn, skip_special_tokens=True))
    right = sum(a == p.answer for a, p in zip(answers, problems, strict=True))
    called = set(follow_index)
    called_right = sum(a == p.answer for i, (a, p) in enumerate(zip(answers, problems, strict=True))
                       if i in called)
    return {"success": right / len(problems), "call_rate": calls / len(problems),
            "success_when_called": called_right / max(calls, 1)}
