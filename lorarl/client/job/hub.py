"""Hugging Face Hub model ids as users write them (``model.path: Qwen/Qwen3-8B``), resolved through
huggingface_hub's own cache (HF_HOME / HF_HUB_CACHE) and offline switch (HF_HUB_OFFLINE), as TRL, verl and
OpenRLHF take them.

A job file is resolved from the cache alone (a dry run never downloads a model); `lorarl run` downloads a model
that is not cached before it starts anything, where the network allows, and says so when offline.
"""

from __future__ import annotations

import re
from pathlib import Path

from lorarl.common.config import ConfigError

#: ``org/name``: what the Hub calls a repo id (a local folder of that name wins).
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_repo_id(path: str) -> bool:
    return bool(REPO_ID.fullmatch(path)) and not Path(path).exists()


def cached_model(repo_id: str) -> str | None:
    """The snapshot folder of ``repo_id`` in the Hugging Face cache, or None where it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def download_model(repo_id: str) -> str:
    """``repo_id`` from the cache, downloaded into it first where it is missing; ConfigError naming model.path when
    it cannot be had (offline, no such repo, no network)."""
    from huggingface_hub import constants, snapshot_download

    found = cached_model(repo_id)
    if found is not None:
        return found
    if constants.HF_HUB_OFFLINE:
        raise ConfigError("model.path", f"{repo_id!r} is a Hugging Face Hub model that is not in the cache "
                                        f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: download it where the "
                                        f"network allows (`hf download {repo_id}`), or give a local folder")
    print(f"lorarl: downloading {repo_id} into the Hugging Face cache ({constants.HF_HUB_CACHE})", flush=True)
    try:
        return snapshot_download(repo_id)
    except Exception as e:  # network, auth, a gated or missing repo: all the user's to fix
        why = str(e).splitlines()[0][:200] if str(e) else ""
        raise ConfigError("model.path", f"{repo_id!r} is no local folder, and it cannot be downloaded from the "
                                        f"Hugging Face Hub ({type(e).__name__}: {why})") from None
