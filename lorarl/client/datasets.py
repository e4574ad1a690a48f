"""Where prompts and gold answers come from: the shipped tasks, a JSONL file, or GSM8K-style data.

Every source yields ``Example(prompt, answer)``; the train stream is an endless seeded shuffle with
a cursor (so a resumed job continues where it stopped), the held-out split a fixed list.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from lorarl.common.config import ConfigError

GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,\.]+)")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def _read_jsonl(path: str, key: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, f"no such file: {path!r}")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(key, f"{path}:{i} is not JSON: {e}") from None
    if not rows:
        raise ConfigError(key, f"{path!r} holds no examples")
    return rows


def gsm8k_gold(answer: str) -> str:
    """The final number of a GSM8K solution ('... #### 72' -> '72')."""
    m = GSM8K_ANSWER.search(answer)
    return (m.group(1) if m else answer).replace(",", "").strip()


def load_examples(source: str, split: str, path: str = "") -> list[Example]:
    key = f"data.{split}_path"
    if source == "tasks":
        from lorarl.assets.tasks import load_split

        return [Example(p.prompt, p.answer) for p in load_split(split)]
    rows = _read_jsonl(path, key)
    out = []
    for i, row in enumerate(rows):
        if source == "gsm8k":
            prompt, answer = row.get("question"), row.get("answer")
            answer = gsm8k_gold(answer) if isinstance(answer, str) else answer
        else:
            prompt, answer = row.get("prompt"), row.get("answer")
        if not isinstance(prompt, str) or not isinstance(answer, str):
            raise ConfigError(key, f"row {i + 1} of {path!r} needs string fields "
                                   f"{'question/answer' if source == 'gsm8k' else 'prompt/answer'}")
        out.append(Example(prompt, answer))
    return out


class TrainStream:
    """An endless shuffled pass over the train examples; ``cursor`` counts examples handed out."""

    def __init__(self, examples: list[Example], seed: int, cursor: int = 0) -> None:
        if not examples:
            raise ValueError("no training examples")
        self.examples, self.seed, self.cursor = examples, seed, 0
        self._order: list[int] = []
        self._epoch = -1
        self.take(cursor)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.examples))
        if epoch != self._epoch:
            self._order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order[offset]

    def take(self, n: int) -> list[Example]:
        batch = [self.examples[self._index(self.cursor + i)] for i in range(n)]
        self.cursor += n
        return batch
