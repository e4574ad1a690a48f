"""`lorarl data gsm8k OUT`: GSM8K as the job files in examples/models read it, OUT/train.jsonl and OUT/test.jsonl,
one {"question", "answer"} row a line (the answer the whole solution, '... #### 72': data.source=gsm8k takes the
number from it).

The rows come from the Hugging Face Hub's openai/gsm8k (configuration main) through `datasets`: from its cache
(HF_HOME / HF_DATASETS_CACHE) where they are there, else downloaded into it first; with HF_HUB_OFFLINE or
HF_DATASETS_OFFLINE set, a dataset not cached is an error that says so. A job can read the Hub dataset without
these files (data.dataset: openai/gsm8k, data.config: main); the files are for job files that name JSONL paths.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lorarl.client.job.datasets import GSM8K_HUB
from lorarl.common.config import ConfigError

#: The columns a GSM8K row keeps (data.source=gsm8k reads them).
GSM8K_COLUMNS = ("question", "answer")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("data", help="write a dataset the example jobs read (GSM8K as JSONL)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=["gsm8k"], help="the dataset to write")
    parser.add_argument("out", metavar="OUT", help="folder for train.jsonl and test.jsonl (e.g. data/gsm8k)")
    parser.add_argument("--dataset", default=GSM8K_HUB[0], metavar="ORG/NAME",
                        help=f"the Hub dataset to read (default {GSM8K_HUB[0]}; a mirror or a fork)")
    parser.add_argument("--config", default=GSM8K_HUB[1], help=f"its configuration (default {GSM8K_HUB[1]})")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lorarl.client.job.hub_datasets import download_dataset

    out = Path(args.out)
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError("OUT", f"{args.out!r} is a file; name a folder for train.jsonl and test.jsonl")
        builder = download_dataset(args.dataset, args.config, "--dataset")
        written = [write_split(builder, args.dataset, split, out) for split in ("train", "test")]
    except ConfigError as e:
        print(f"lorarl data: {e}", file=sys.stderr)
        return 2
    for path, rows in written:
        print(f"wrote {rows} rows to {path}")
    return 0


def write_split(builder: Any, repo_id: str, split: str, out: Path) -> tuple[Path, int]:
    """One split of the cached dataset as OUT/<split>.jsonl (written aside, then renamed: an interrupted write
    leaves no half file that a job would read as the whole split)."""
    from lorarl.client.job.hub_datasets import split_rows

    rows = split_rows(builder, repo_id, split, "--dataset")
    if missing := [c for c in GSM8K_COLUMNS if c not in rows.column_names]:
        raise ConfigError("--dataset", f"{repo_id!r} has no column {missing[0]!r} (columns: {rows.column_names}); "
                                       f"GSM8K rows are {list(GSM8K_COLUMNS)}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{split}.jsonl"
    partial = out / f".{split}.jsonl.partial"
    with partial.open("w") as f:
        for row in rows.select_columns(list(GSM8K_COLUMNS)):
            f.write(json.dumps(row) + "\n")
    partial.replace(path)
    return path, len(rows)
