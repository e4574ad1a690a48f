"""The mixed base's two domains in one dataset (lorarl.assets.mixed_task, examples/distill/student.yaml): the
shipped files are what the builder makes, each held-out row is its domain's own held-out problem (so a student's
eval/<task>/accuracy and an expert's eval/accuracy count the same problems), no train row is held out, and the
reward follows the row's task."""

from __future__ import annotations

import json

import pytest

from lorarl.assets.mixed_task import MIXED_TASKS_DIR, TRAIN_PER_TASK, sort_or_tool_reward, write_splits
from lorarl.assets.tasks import load_split
from lorarl.assets.tool_task import load_tool_split


def rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (MIXED_TASKS_DIR / f"{split}.jsonl").read_text().splitlines()]


def test_shipped_mixed_splits_are_what_the_builder_makes(tmp_path) -> None:
    for split, path in write_splits(tmp_path).items():
        assert path.read_bytes() == (MIXED_TASKS_DIR / f"{split}.jsonl").read_bytes(), split


def test_held_out_rows_are_each_domains_held_out_split_and_train_rows_are_not_held_out() -> None:
    test, train = rows("test"), rows("train")
    sort_test = [(p.prompt, p.answer) for p in load_split("test") if p.task == "sort"]
    tools_test = [(p.prompt, p.answer) for p in load_tool_split("test")]
    assert [(r["prompt"], r["answer"]) for r in test if r["task"] == "sort"] == sort_test
    assert [(r["prompt"], r["answer"]) for r in test if r["task"] == "tools"] == tools_test
    assert {r["task"] for r in test} == {"sort", "tools"} and len(test) == len(sort_test) + len(tools_test)
    assert [sum(r["task"] == task for r in train) for task in ("sort", "tools")] == [TRAIN_PER_TASK] * 2
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    first = [r["task"] for r in train[:200]]  # shuffled together: a step's prompts hold both domains
    assert 50 < first.count("tools") < 150


def test_the_reward_follows_the_rows_task() -> None:
    assert sort_or_tool_reward("sort 312", "123<|im_end|>", answer="123", task="sort") == 1.0
    assert sort_or_tool_reward("sort 312", "132<|im_end|>", answer="123", task="sort") == pytest.approx(0.1)
    assert sort_or_tool_reward("347*29=", "10063", answer="10063", task="tools") == 1.0
    assert sort_or_tool_reward("347*29=", "10036", answer="10063", task="tools") == 0.0
    # the sort reward's format bonus is not the agent's: a well-formed wrong product earns nothing
    assert sort_or_tool_reward("347*29=", "132<|im_end|>", answer="10063", task="tools") == 0.0
    with pytest.raises(ValueError, match="task 'add' is neither 'sort' nor 'tools'"):
        sort_or_tool_reward("1+1=", "2", answer="2", task="add")
