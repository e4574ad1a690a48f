"""A Hugging Face Hub dataset in a ``datasets`` cache, built with no network: what `datasets.load_dataset(ID, CONFIG)`
leaves in HF_DATASETS_CACHE after a download (ORG___NAME/CONFIG/0.0.0/HASH/: dataset_info.json and one
NAME-SPLIT.arrow per split), which an offline load_dataset then reads as the Hub's. ``push_to_hub`` cannot run
here, so the rows go through datasets' own JSON builder under the dataset's name and configuration, and the
prepared folder is moved to where a download of ORG/NAME would have put it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def cache_hub_dataset(cache: Path, repo_id: str, config: str, splits: dict[str, list[dict[str, Any]]]) -> Path:
    """``splits`` (split name -> rows) as configuration ``config`` of Hub dataset ``repo_id`` in the datasets
    cache ``cache``; returns the prepared folder."""
    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    org, name = repo_id.split("/")
    work = cache.parent / f"build-{org}-{name}-{config}"
    files = {}
    for split, rows in splits.items():
        (work / "rows").mkdir(parents=True, exist_ok=True)
        path = work / "rows" / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        files[split] = [str(path)]
    datasets.disable_progress_bars()
    builder = Json(cache_dir=str(work / "prepared"), dataset_name=name, config_name=config, config_id=config,
                   data_files=DataFilesDict.from_patterns(files), hash="0" * 16)
    builder.download_and_prepare()
    target = cache / f"{org}___{camelcase_to_snakecase(name)}" / config
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(work / "prepared" / name / config), str(target))
    shutil.rmtree(work)
    return target
