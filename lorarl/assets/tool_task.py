"""A multi-turn tool task the tiny models can learn: multiply with a calculator tool, read its result, answer.

    user:       347*29=
    assistant:  <tool_call>{"name": "calc", "arguments": {"expr": "347*29"}}</tool_call>
    tool:       10063
    assistant:  10063

A three-digit by two-digit product is beyond what a 1M-parameter model computes, so the reward (the
final answer equals the product) is earned by calling the tool and copying its result. The shipped
``qwen3-tiny-tools`` policy imitates a fallible agent (lorarl.assets.pretrain's ``ToolTeacher``): it always
knows the format, but on some problems it skips the call and answers a shortcut guess, and on most calls
it misreads the tool's result (its last two digits swapped). Greedy decoding is then right only where the
misreading is harmless; sampling finds the right episode often; reinforcement learning teaches it to call
and copy faithfully. Conversations are rendered by the model's own chat template (tools in Qwen3's format),
exactly as the rollout's OpenAI-compatible endpoint renders them for an agent.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lorarl.assets.paths import DATA_DIR, write_jsonl_splits

TOOL_TASKS_DIR = DATA_DIR / "tools"
SPLITS_SEED = 20261202
TRAIN_SIZE, TEST_SIZE = 6000, 200
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"expr": "string"}}}]
"""The calculator as an OpenAI tool (its schema kept short: every character is a token here)."""

_EXPR = re.compile(r"\s*(\d{1,6})\s*\*\s*(\d{1,6})\s*")


@dataclass(frozen=True)
class ToolProblem:
    prompt: str  # "347*29="
    answer: str  # "10063"

    @property
    def expr(self) -> str:
        return self.prompt.rstrip("=")


def calculate(expr: str) -> str:
    """The calculator: the product of ``a*b`` (digits only), or an error message the agent reads."""
    match = _EXPR.fullmatch(expr or "")
    if match is None:
        return "error: calc takes a*b"
    return str(int(match.group(1)) * int(match.group(2)))


def shortcut_guess(problem: ToolProblem) -> str:
    """What a hurried agent answers without the tool: the product with the second factor rounded down."""
    a, b = (int(x) for x in problem.expr.split("*"))
    return str(a * (b // 10 * 10))


def misread(result: str) -> str:
    """The result with its last two digits swapped (harmless when they are equal)."""
    return result[:-2] + result[-1] + result[-2] if len(result) >= 2 else result


def build_splits(seed: int = SPLITS_SEED) -> dict[str, list[ToolProblem]]:
    """Disjoint train and test problems from a seeded draw of all a*b, a in 100..999, b in 10..99."""
    pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    problems = [ToolProblem(f"{a}*{b}=", str(a * b)) for a, b in pairs[: TEST_SIZE + TRAIN_SIZE]]
    return {"test": problems[:TEST_SIZE], "train": problems[TEST_SIZE:]}


def write_splits(out_dir: Path = TOOL_TASKS_DIR) -> dict[str, Path]:
    return write_jsonl_splits(out_dir, {split: [json.dumps(asdict(p), sort_keys=True) for p in problems]
                                        for split, problems in build_splits().items()})


def load_tool_split(split: str, tasks_dir: Path = TOOL_TASKS_DIR) -> list[ToolProblem]:
    with (tasks_dir / f"{split}.jsonl").open() as f:
        return [ToolProblem(**json.loads(line)) for line in f if line.strip()]


def tool_call(expr: str) -> dict[str, Any]:
    return {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}


def conversation(problem: ToolProblem, behaviour: str) -> list[dict[str, Any]]:
    """The episode as chat messages: ``gold`` (call, copy), ``skip`` (guess without the tool) or
    ``misread`` (call, then answer the result misread)."""
    user = {"role": "user", "content": problem.prompt}
    if behaviour == "skip":
        return [user, {"role": "assistant", "content": shortcut_guess(problem)}]
    result = calculate(problem.expr)
    final = result if behaviour == "gold" else misread(result)
    return [user, {"role": "assistant", "content": "", "tool_calls": [tool_call(problem.expr)]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": final}]


def final_answer(text: str) -> str | None:
    """The digits an answer turn gives (its whole stripped text), else None."""
    text = text.split("<|im_end|>", 1)[0].strip()
    return text if re.fullmatch(r"[0-9]{1,9}", text) else None


def tool_reward(completion: str, answer: Any) -> float:
    """1.0 when the episode's last turn answers the product."""
    return 1.0 if final_answer(completion) == str(answer) else 0.0
