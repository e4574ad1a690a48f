"""Where examples come from: the shipped tasks, JSONL files, GSM8K-style data, any local dataset that
Hugging Face ``datasets`` reads (jsonl, json, parquet, csv, arrow, a ``save_to_disk`` folder), or a Hugging Face
Hub dataset in the local cache (``data.dataset``, with its configuration ``data.config``; see
lorarl.client.job.hub_datasets for the cache and the download).

A Hub dataset is a key, not a source: ``data.source`` says how a row becomes an example (``gsm8k``: the
``question``/``answer`` columns and the gold number taken from the solution; ``datasets``: any columns, as
``data.columns`` maps them), ``data.dataset`` where both splits come from (``data.train_split`` /
``data.test_split`` of it). So GSM8K read from the Hub and GSM8K read from JSONL files take the one gsm8k path,
and any other Hub dataset the one ``datasets`` path; a source of its own for the Hub would need a second
switch for the format.

Every source yields ``Example(prompt, answer, columns)``: the prompt a string or a chat (a list of
``{"role", "content"}`` messages, decided by the column's type, never by parsing text), the answer any
JSON value, and every column of the row for the reward and the workflow. The train stream is an endless
seeded shuffle with a cursor (so a resumed job continues where it stopped), the held-out split a fixed
list.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from lorarl.common.config import ConfigError

GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,\.]+)")
SOURCES = ("tasks", "jsonl", "gsm8k", "datasets")
#: GSM8K on the Hugging Face Hub (dataset, configuration): what `lorarl data gsm8k` writes as JSONL files.
GSM8K_HUB = ("openai/gsm8k", "main")
#: The sources ``data.dataset`` (a Hub dataset's splits) is read with.
HUB_SOURCES = ("datasets", "gsm8k")
#: File endings ``data.source: datasets`` reads, and the ``datasets`` builder for each.
DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class MissingDataError(ConfigError):
    """Data the job names that is not there yet: a file or folder that does not exist, a Hub dataset not in the
    cache. A dry run plans without it and says what makes it (``fix``); `lorarl run` refuses it before anything
    starts."""

    def __init__(self, key: str, what: str, fix: str = "") -> None:
        super().__init__(key, f"{what}; {fix}" if fix else what)
        self.what, self.fix = what, fix


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
        raise (ConfigError(key, f"{path!r} is a folder, not a JSONL file") if p.exists()
               else MissingDataError(key, f"no such file: {path!r}"))
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


def _dataset_rows(path: str, split: str, key: str, split_key: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows through Hugging Face ``datasets``: a local file or folder, else a Hub name from the local cache
    (nothing is downloaded). ``limit``: stream only the first rows (what --dry-run reads)."""
    import datasets

    datasets.disable_progress_bars()
    local = Path(path)
    if not local.exists():
        from lorarl.client.job.hub_datasets import cache_dir

        return _hub_rows(path, "", split, key, split_key, limit, missing=f"no such file or folder: {path!r} (nor a "
                         f"Hugging Face Hub dataset of that name in the datasets cache, {cache_dir()})")
    try:
        if local.is_dir() and (local / "dataset_info.json").is_file():  # Dataset.save_to_disk
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                data = data[split]
            rows: Iterable[dict[str, Any]] = data
        else:
            builder = DATASET_FORMATS.get(local.suffix) if local.is_file() else None
            if local.is_file() and builder is None:
                raise ConfigError(key, f"{path!r}: unknown file type {local.suffix!r}; data.source=datasets reads "
                                       f"{sorted(DATASET_FORMATS)} files, a save_to_disk folder, or a Hub dataset "
                                       "(data.dataset)")
            if builder is None:
                rows = datasets.load_dataset(str(local), split=split, streaming=limit is not None)
            else:
                rows = datasets.load_dataset(builder, data_files=str(local), split="train", streaming=limit is not None)
        return list(islice(rows, limit))
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many kinds: FileNotFoundError, KeyError (a split), ArrowInvalid...
        raise ConfigError(key, f"{path!r} ({split}): unreadable: {type(e).__name__}: {str(e)[:300]}") from None


def _hub_rows(repo_id: str, config: str, split: str, key: str, split_key: str, limit: int | None,
              missing: str) -> list[dict[str, Any]]:
    """The rows of one split of a Hub dataset in the datasets cache; ``missing``: the MissingDataError's problem
    when it is not there."""
    from lorarl.client.job.hub_datasets import cache_dir, cached_builder, split_rows

    builder = cached_builder(repo_id, config, key)
    if builder is None:
        raise MissingDataError(key, missing)
    try:
        return list(islice(split_rows(builder, repo_id, split, split_key), limit))
    except ConfigError:
        raise
    except Exception as e:  # a cache entry that does not read back (half-written, another datasets version)
        raise ConfigError(key, f"{repo_id!r} ({split}) in the datasets cache ({cache_dir()}): unreadable: "
                               f"{type(e).__name__}: {str(e)[:300]}") from None


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
                  dataset_split: str = "", limit: int | None = None, tasks: Sequence[str] = (), *,
                  dataset: str = "", config: str = "") -> list[Example]:
    """The examples of one split (``limit``: only the first few, as --dry-run reads them; ``tasks``: only these
    of the shipped tasks; ``dataset``: a Hub dataset (its ``config``) whose split ``dataset_split`` is read
    instead of ``path``). Data that is not there is a MissingDataError naming its key."""
    key, split_key = ("data.dataset" if dataset else f"data.{split}_path"), f"data.{split}_split"
    if source == "tasks":
        from lorarl.assets.tasks import load_split

        problems = [p for p in load_split(split) if not tasks or p.task in tasks][:limit]
        return [Example(p.prompt, p.answer, {"prompt": p.prompt, "answer": p.answer, "task": p.task})
                for p in problems]
    if source not in SOURCES:
        raise ConfigError("data.source", f"expected one of {list(SOURCES)}, got {source!r}")
    columns = dict(columns or {})
    if source == "gsm8k":
        prompt_column, answer_column = columns.get("prompt", "question"), columns.get("answer", "answer")
    else:
        prompt_column, answer_column = columns.get("prompt", "prompt"), columns.get("answer", "answer")
    if dataset:
        from lorarl.client.job.hub_datasets import cache_dir, describe

        where = describe(dataset, config)
        rows = _hub_rows(dataset, config, dataset_split or split, key, split_key, limit,
                         missing=f"{where} is not in the datasets cache ({cache_dir()})")
    elif source == "datasets":
        where, rows = repr(path), _dataset_rows(path, dataset_split or split, key, split_key, limit)
    else:
        where, rows = repr(path), _read_jsonl(path, key, limit)
    if not rows:
        raise ConfigError(key, f"{where} holds no examples" + (f" in split {dataset_split or split!r}" if dataset
                                                                else ""))
    out = []
    for i, row in enumerate(rows):
        example = to_example(row, prompt_column, answer_column, key, f"row {i + 1} of {where}")
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
