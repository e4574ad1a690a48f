"""Hugging Face Hub datasets as users write them (``data.dataset: openai/gsm8k``, ``data.config: main``), held
in the ``datasets`` library's own cache (HF_HOME / HF_DATASETS_CACHE) under its own offline switch
(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), as TRL takes ``dataset_name`` / ``dataset_config``.

Reading never downloads: a dataset is looked up in the cache alone, so a dry run's plan reads what is there and
says what is not. `lorarl run` and `lorarl data` download one that is not cached first, where the network allows,
and say so when offline (lorarl.client.job.hub does the same for models).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lorarl.common.config import ConfigError


def describe(repo_id: str, config: str) -> str:
    return f"{repo_id!r}" + (f" (config {config!r})" if config else "")


def cache_dir() -> str:
    """Where ``datasets`` keeps prepared datasets: HF_DATASETS_CACHE, else HF_HOME/datasets."""
    import datasets.config

    return str(datasets.config.HF_DATASETS_CACHE)


def offline() -> bool:
    """HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set: nothing may be downloaded."""
    import datasets.config
    import huggingface_hub.constants

    return bool(datasets.config.HF_HUB_OFFLINE or huggingface_hub.constants.HF_HUB_OFFLINE)


@contextlib.contextmanager
def cache_only() -> Iterator[None]:
    """Offline mode (and no progress bars or cache notices) for one lookup: a name resolves from the local cache
    or fails at once, whatever the network and the environment allow."""
    import datasets
    import datasets.config
    import huggingface_hub.constants

    was = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    verbosity = datasets.logging.get_verbosity()
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity_error()  # "Using the latest cached version...": the plan says where it read
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = was
        datasets.logging.set_verbosity(verbosity)


def cached_builder(repo_id: str, config: str, key: str) -> Any | None:
    """The prepared dataset's builder from the cache (its ``info.splits`` say which splits there are, and
    ``as_dataset(split)`` reads one), or None where ``repo_id`` (with ``config``) is not cached. Several cached
    configurations and no ``config`` named: ConfigError naming data.config."""
    import datasets

    with cache_only():
        try:
            return datasets.load_dataset_builder(repo_id, config or None)
        except (ConnectionError, FileNotFoundError):  # nothing cached under that name
            return None
        except ValueError as e:
            if str(e).startswith("Couldn't find cache"):  # cached, but not that configuration
                return None
            if "multiple" in str(e) and "configurations" in str(e):
                raise ConfigError("data.config", f"{key} {repo_id!r} has several configurations in the cache; name "
                                                 f"one: {str(e).splitlines()[0]}") from None
            raise ConfigError(key, f"{repo_id!r} in the datasets cache ({cache_dir()}): {e}") from None


def download_dataset(repo_id: str, config: str, key: str) -> Any:
    """``repo_id`` from the cache, downloaded and prepared into it first where it is missing; ConfigError naming
    ``key`` when it cannot be had (offline, no such dataset or configuration, no network)."""
    import datasets

    found = cached_builder(repo_id, config, key)
    if found is not None:
        return found
    if offline():
        raise ConfigError(key, f"{describe(repo_id, config)} is a Hugging Face Hub dataset that is not in the "
                               f"datasets cache ({cache_dir()}) and HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: "
                               "fetch it where the network allows, into the same HF_HOME (`lorarl run`, `lorarl data` "
                               "or datasets.load_dataset there download it), then run offline")
    print(f"lorarl: downloading {describe(repo_id, config)} into the datasets cache ({cache_dir()})", flush=True)
    try:
        builder = datasets.load_dataset_builder(repo_id, config or None)
        builder.download_and_prepare()
    except Exception as e:  # network, auth, a gated or missing dataset, an unknown config: all the user's to fix
        why = str(e).splitlines()[0][:300] if str(e) else ""
        raise ConfigError(key, f"{describe(repo_id, config)} cannot be downloaded from the Hugging Face Hub "
                               f"({type(e).__name__}: {why})") from None
    return builder


def split_rows(builder: Any, repo_id: str, split: str, split_key: str) -> Any:
    """One split of a cached dataset (a ``datasets.Dataset``, memory-mapped); a split it does not have is a
    ConfigError naming ``split_key`` with the ones it has."""
    splits = sorted(builder.info.splits or {})
    if split not in splits:
        raise ConfigError(split_key, f"{repo_id!r} has no split {split!r}; its splits: {splits}")
    with cache_only():
        return builder.as_dataset(split=split)
