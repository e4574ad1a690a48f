"""Synthetic tasks with verifiable rewards: the problems every part of lorarl trains and evaluates on.

Two task kinds share one answer format (a short string of digits), so one extractor and one reward
serve both:

* ``add``:  ``"57+68="`` -> ``"125"``   (two-digit operands)
* ``sort``: ``"sort 30931"`` -> ``"01339"`` (five digits, ascending, duplicates kept)

Each kind also knows its *slip*: the characteristic mistake of a hurried student (forgetting to
carry; dropping repeated digits). :mod:`lorarl.assets.pretrain` imitates a teacher that slips often, so the
shipped base policies know the right procedure but prefer the slip wherever it changes the answer.
That leaves exactly the room reinforcement learning needs: greedy decoding is right only where the
slip is harmless (about a quarter of problems), while sampling finds the right answer easily, and a
reward of 1.0 for the right answer teaches the policy to stop slipping.

The splits are fixed: :func:`build_splits` enumerates problems from a seeded generator and
:func:`write_splits` stores them as JSON lines (``prompt``, ``answer``, ``task``); test prompts
never occur in train.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from lorarl.assets.paths import TASKS_DIR, write_jsonl_splits

SPLITS_SEED = 20240601
"""Seed of the generator that draws the fixed train/test splits."""

TEST_PER_TASK = 150
"""Held-out problems per task kind (300 in all)."""

TRAIN_PER_TASK = 7_500
"""Training problems per task kind (``add`` has 8100 problems in all, so it keeps what test leaves)."""

EOS_MARKERS = ("<|im_end|>", "<|endoftext|>")
"""End-of-turn texts that may trail a completion when special tokens are not skipped."""

_ANSWER_RE = re.compile(r"[0-9]{1,8}")


@dataclass(frozen=True)
class Problem:
    """One task instance as stored in the split files."""

    prompt: str
    answer: str
    task: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, row: dict[str, str]) -> Problem:
        return cls(prompt=row["prompt"], answer=row["answer"], task=row["task"])


class TaskKind(Protocol):
    """What a task kind provides: its problem universe, the gold answer and the teacher's slip."""

    name: str

    def universe(self, rng: random.Random) -> Iterable[str]:
        """Distinct prompts in a seeded order; the splits take their problems from its head."""
        ...

    def solve(self, prompt: str) -> str:
        """The gold answer."""
        ...

    def slip(self, prompt: str) -> str:
        """The characteristic wrong answer (equal to the gold one where the slip does no harm)."""
        ...


class AddTask:
    """Two-digit addition; the slip forgets every carry (each column written mod 10)."""

    name = "add"

    def universe(self, rng: random.Random) -> Iterable[str]:
        pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
        rng.shuffle(pairs)
        return (f"{a}+{b}=" for a, b in pairs)

    @staticmethod
    def _operands(prompt: str) -> tuple[int, int]:
        a, b = prompt.rstrip("=").split("+")
        return int(a), int(b)

    def solve(self, prompt: str) -> str:
        a, b = self._operands(prompt)
        return str(a + b)

    def slip(self, prompt: str) -> str:
        a, b = self._operands(prompt)
        digits = [(int(x) + int(y)) % 10 for x, y in zip(f"{a:02d}", f"{b:02d}", strict=True)]
        return str(int("".join(map(str, digits))))


class SortTask:
    """Sort five digits ascending; the slip drops repeated digits."""

    name = "sort"
    length = 5

    def universe(self, rng: random.Random) -> Iterable[str]:
        seen: set[str] = set()
        while len(seen) < 10**self.length:
            digits = "".join(rng.choice("0123456789") for _ in range(self.length))
            if digits not in seen:
                seen.add(digits)
                yield f"sort {digits}"

    def solve(self, prompt: str) -> str:
        return "".join(sorted(prompt.removeprefix("sort ")))

    def slip(self, prompt: str) -> str:
        return "".join(sorted(set(prompt.removeprefix("sort "))))


TASK_KINDS: dict[str, TaskKind] = {kind.name: kind for kind in (AddTask(), SortTask())}


def task_kind(name: str) -> TaskKind:
    """The task kind called ``name`` (``add`` or ``sort``)."""
    try:
        return TASK_KINDS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASK_KINDS)}") from None


# ---------------------------------------------------------------------------------------------- splits


def build_splits(
    seed: int = SPLITS_SEED, test_per_task: int = TEST_PER_TASK, train_per_task: int = TRAIN_PER_TASK
) -> dict[str, list[Problem]]:
    """Draw the train and test splits: per kind, the first prompts of a seeded universe go to test,
    the next ones to train, so the two are disjoint by construction."""
    splits: dict[str, list[Problem]] = {"train": [], "test": []}
    for name in sorted(TASK_KINDS):
        kind = TASK_KINDS[name]
        rng = random.Random(f"{seed}:{name}")
        universe = iter(kind.universe(rng))
        for split, count in (("test", test_per_task), ("train", train_per_task)):
            for _ in range(count):
                prompt = next(universe, None)
                if prompt is None:
                    break
                splits[split].append(Problem(prompt=prompt, answer=kind.solve(prompt), task=name))
    for split in splits.values():
        random.Random(seed).shuffle(split)
    return splits


def write_splits(out_dir: Path = TASKS_DIR, seed: int = SPLITS_SEED) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` under ``out_dir``; returns their paths."""
    return write_jsonl_splits(out_dir, {split: [p.to_json() for p in problems]
                                        for split, problems in build_splits(seed).items()})


def load_split(split: str, tasks_dir: Path = TASKS_DIR) -> list[Problem]:
    """The shipped ``train`` or ``test`` problems, in file order."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    path = tasks_dir / f"{split}.jsonl"
    with path.open() as f:
        return [Problem.from_dict(json.loads(line)) for line in f if line.strip()]


# --------------------------------------------------------------------------------------------- rewards


def strip_eos(completion: str) -> str:
    """The completion up to its first end-of-turn marker (vLLM may or may not have removed it)."""
    for marker in EOS_MARKERS:
        completion = completion.split(marker, 1)[0]
    return completion


def extract_answer(completion: str) -> str | None:
    """The answer a completion gives: the whole completion, stripped, if it is a digit string;
    otherwise ``None`` (a malformed answer never counts, so the policy must keep the format)."""
    text = strip_eos(completion).strip()
    return text if _ANSWER_RE.fullmatch(text) else None


def exact_reward(completion: str, answer: str) -> float:
    """1.0 for the gold answer, else 0.0."""
    return 1.0 if extract_answer(completion) == answer else 0.0


FORMAT_BONUS = 0.1


def exact_format_reward(completion: str, answer: str) -> float:
    """1.0 for the gold answer, ``FORMAT_BONUS`` for a well-formed wrong one, 0.0 for malformed text."""
    extracted = extract_answer(completion)
    if extracted is None:
        return 0.0
    return 1.0 if extracted == answer else FORMAT_BONUS


def format_reward(completion: str, answer: str) -> float:
    """1.0 whenever the completion is a well-formed answer, right or wrong (a diagnostic component)."""
    del answer
    return 0.0 if extract_answer(completion) is None else 1.0


RewardFn = Callable[[str, str], float]

REWARD_FNS: dict[str, RewardFn] = {
    "exact": exact_reward,
    "exact_format": exact_format_reward,
    "format": format_reward,
}
DEFAULT_REWARD = "exact"


def reward_fn(name: str = DEFAULT_REWARD) -> RewardFn:
    """The reward function registered as ``name``: ``(completion_text, gold_answer) -> float``."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; known: {sorted(REWARD_FNS)}") from None


def accuracy(completions: Sequence[str], problems: Sequence[Problem]) -> float:
    """Fraction of completions that earn the exact reward."""
    if len(completions) != len(problems):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems")
    if not problems:
        return 0.0
    return sum(exact_reward(c, p.answer) for c, p in zip(completions, problems, strict=True)) / len(problems)
