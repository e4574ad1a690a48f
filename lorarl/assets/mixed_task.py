"""The mixed base's two domains in one dataset: digit sorting (single turn) and the calculator agent (multi-turn),
each row named by its ``task`` column. What a job that learns both at once reads: the student of
examples/distill, distilled from the two RL experts of examples/multitenant, and its RL-from-scratch twin.

Built from the shipped splits (lorarl.assets.tasks' sort rows, lorarl.assets.tool_task's rows): the held-out rows
are each domain's whole held-out split, so the student's ``eval/<task>/accuracy`` and each expert's
``eval/accuracy`` are measured on the same problems; the train rows are the first ``TRAIN_PER_TASK`` of each
domain's train split, shuffled together. The reward follows the row's task: the sort job's (exact, 0.1 for a
well-formed wrong answer) or the agent job's (the last turn answers the product).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from lorarl.assets.paths import DATA_DIR, write_jsonl_splits
from lorarl.assets.tasks import exact_format_reward, load_split
from lorarl.assets.tool_task import load_tool_split, tool_reward

MIXED_TASKS_DIR = DATA_DIR / "mixed"
SORT, TOOLS = "sort", "tools"
TRAIN_PER_TASK = 3_000
SPLITS_SEED = 20261207


def build_splits(seed: int = SPLITS_SEED, train_per_task: int = TRAIN_PER_TASK) -> dict[str, list[dict[str, str]]]:
    """Rows ``{prompt, answer, task}``: test is every held-out sort and tool problem (in that order), train the
    first ``train_per_task`` of each domain's train split, shuffled together by ``seed``."""
    splits: dict[str, list[dict[str, str]]] = {}
    for split in ("test", "train"):
        limit = None if split == "test" else train_per_task
        sort = [{"prompt": p.prompt, "answer": p.answer, "task": SORT} for p in load_split(split) if p.task == SORT]
        tools = [{"prompt": p.prompt, "answer": p.answer, "task": TOOLS} for p in load_tool_split(split)]
        splits[split] = sort[:limit] + tools[:limit]
    random.Random(seed).shuffle(splits["train"])
    return splits


def write_splits(out_dir: Path = MIXED_TASKS_DIR, seed: int = SPLITS_SEED) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` under ``out_dir``; returns their paths."""
    return write_jsonl_splits(out_dir, {split: [json.dumps(row, sort_keys=True) for row in rows]
                                        for split, rows in build_splits(seed).items()})


def sort_or_tool_reward(prompt: Any, completion: str, answer: Any, task: str, **columns: Any) -> float:
    """The reward of the row's domain: the sort job's for ``sort``, the calculator agent's for ``tools``."""
    if task == SORT:
        return exact_format_reward(completion, str(answer))
    if task == TOOLS:
        return tool_reward(completion, answer)
    raise ValueError(f"task {task!r} is neither {SORT!r} nor {TOOLS!r}")
