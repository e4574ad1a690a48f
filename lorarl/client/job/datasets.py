"""Where examples come from: the shipped tasks, JSONL files, GSM8K-style data, or any local dataset that
Hugging Face ``datasets`` reads (jsonl, json, parquet, csv, arrow, a ``save_to_disk`` folder, or a hub
dataset already in the local cache).

Every source yields ``Example(prompt, answer, columns)``: the prompt a string or a chat (a list of
``{"role", "content"}`` messages, decided by the column's type, never by parsing text), the answer any
JSON value, and every column of the row for the reward and the workflow. The train stream is an endless
seeded shuffle with a cursor (so a resumed job continues where it stopped), the held-out split a fixed
list.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from lorarl.common.config import ConfigError

GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,\.]+)")
SOURCES = ("tasks", "jsonl", "gsm8k", "datasets")
#: File endings ``data.source: datasets`` reads, and the ``datasets`` builder for each.
DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


@dataclass(frozen=True)
class Example:
    """One row: the prompt (text or chat messages), the gold answer (any JSON value) and the whole row."""

    prompt: str | list[dict[str, Any]]
    answer: Any
    columns: Mapping[str, Any] = field(default_factory=dict)

    def answer_text(self) -> str:
        """The answer as text, for rewards of the ``(completion, answer)`` form: strings as they are,
        anything else as JSON (46 -> "46")."""
        return self.answer if isinstance(self.answer, str) else json.dumps(self.answer)


def _read_jsonl(path: str, key: str, limit: int | None = None) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, f"no such file: {path!r}")
    rows = []
    with p.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(key, f"{path}:{i} is not JSON: {e}") from None
            if not isinstance(row, dict):
                raise ConfigError(key, f"{path}:{i} is not a JSON object")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ConfigError(key, f"{path!r} holds no examples")
    return rows


def _dataset_rows(path: str, split: str, key: str, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Rows through Hugging Face ``datasets``: a local file or folder, else a hub name from the local cache
    (nothing is downloaded). ``limit``: stream only the first rows (what --dry-run reads)."""
    import datasets

    datasets.disable_progress_bars()
    local = Path(path)
    try:
        if local.is_dir() and (local / "dataset_info.json").is_file():  # Dataset.save_to_disk
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                data = data[split]
            rows: Iterable[dict[str, Any]] = data
        elif local.exists():
            builder = DATASET_FORMATS.get(local.suffix) if local.is_file() else None
            if local.is_file() and builder is None:
                raise ConfigError(key, f"{path!r}: unknown file type {local.suffix!r}; data.source=datasets reads "
                                       f"{sorted(DATASET_FORMATS)} files, a save_to_disk folder or a cached hub name")
            if builder is None:
                rows = datasets.load_dataset(str(local), split=split, streaming=limit is not None)
            else:
                rows = datasets.load_dataset(builder, data_files=str(local), split="train", streaming=limit is not None)
        else:
            with _offline():
                rows = datasets.load_dataset(path, split=split, streaming=False)
        taken = list(islice(rows, limit))
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many kinds: FileNotFoundError, DatasetNotFoundError, ArrowInvalid...
        where = "no such file or folder, and no cached hub dataset of that name" if not local.exists() else "unreadable"
        raise ConfigError(key, f"{path!r} ({split}): {where}: {type(e).__name__}: {str(e)[:300]}") from None
    yield from taken


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hub offline mode for one load: a hub name resolves from the local cache or fails at once."""
    import datasets.config
    import huggingface_hub.constants

    was = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = was


def gsm8k_gold(answer: str) -> str:
    """The final number of a GSM8K solution ('... #### 72' -> '72')."""
    m = GSM8K_ANSWER.search(answer)
    return (m.group(1) if m else answer).replace(",", "").strip()


def _prompt(value: Any, key: str, where: str) -> str | list[dict[str, Any]]:
    """A string, or a chat: a non-empty list of messages with string roles and contents."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and value and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [dict(m) for m in value]
    raise ConfigError(key, f"{where}: the prompt must be a string or a list of {{role, content}} messages, "
                           f"got {type(value).__name__}")


def to_example(row: Mapping[str, Any], prompt_column: str, answer_column: str, key: str, where: str) -> Example:
    """A row as an Example; the named columns must be present."""
    missing = [c for c in (prompt_column, answer_column) if c not in row]
    if missing:
        raise ConfigError(key, f"{where} has no column {missing[0]!r} (columns: {sorted(row)}); "
                               "map yours with data.columns.prompt / data.columns.answer")
    return Example(_prompt(row[prompt_column], key, where), row[answer_column], dict(row))


def load_examples(source: str, split: str, path: str = "", columns: Mapping[str, str] | None = None,
                  dataset_split: str = "", limit: int | None = None, tasks: Sequence[str] = ()) -> list[Example]:
    """The examples of one split (``limit``: only the first few, as --dry-run reads them; ``tasks``: only these
    of the shipped tasks)."""
    key = f"data.{split}_path"
    if source == "tasks":
        from lorarl.assets.tasks import load_split

        problems = [p for p in load_split(split) if not tasks or p.task in tasks][:limit]
        return [Example(p.prompt, p.answer, {"prompt": p.prompt, "answer": p.answer}) for p in problems]
    if source not in SOURCES:
        raise ConfigError("data.source", f"expected one of {list(SOURCES)}, got {source!r}")
    columns = dict(columns or {})
    if source == "gsm8k":
        prompt_column, answer_column = columns.get("prompt", "question"), columns.get("answer", "answer")
    else:
        prompt_column, answer_column = columns.get("prompt", "prompt"), columns.get("answer", "answer")
    rows = (_read_jsonl(path, key, limit) if source != "datasets"
            else list(_dataset_rows(path, dataset_split or split, key, limit)))
    if not rows:
        raise ConfigError(key, f"{path!r} holds no examples")
    out = []
    for i, row in enumerate(rows):
        example = to_example(row, prompt_column, answer_column, key, f"row {i + 1} of {path!r}")
        if source == "gsm8k" and isinstance(example.answer, str):
            example = Example(example.prompt, gsm8k_gold(example.answer), example.columns)
        out.append(example)
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
