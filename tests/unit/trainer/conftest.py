"""Tiny random-init Qwen3 / Qwen3-MoE checkpoints on disk, for engine and checkpoint tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.unit.trainer.tiny import dense_model, moe_model

#: torch's own setter, kept at collection time: an in-process vLLM engine started later in the session
#: replaces torch.set_num_threads with a no-op, which would leave these exactness tests on two threads.
SET_NUM_THREADS = torch.set_num_threads


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP's spin-waiting
    makes them up to 100x slower; restored afterwards so other test folders keep their setting."""
    previous = torch.get_num_threads()
    SET_NUM_THREADS(1)
    yield
    SET_NUM_THREADS(previous)


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dense")
    dense_model().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe")
    moe_model().save_pretrained(path)
    return path
