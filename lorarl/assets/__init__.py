"""Shipped assets: a byte-level tokenizer, synthetic verifiable tasks and two tiny Qwen3 policies.

Paths and the task helpers import cheaply (no torch); ``render_prompt`` (chat template) and
``evaluate_greedy`` load transformers/torch on first use. Rebuild everything with
``python -m lorarl.assets.build``.
"""

from __future__ import annotations

from typing import Any

from lorarl.assets.paths import (
    ASSETS_DIR,
    DATA_DIR,
    DENSE_MODEL_DIR,
    MODELS_DIR,
    MOE_MODEL_DIR,
    TASKS_DIR,
    TOKENIZER_DIR,
)
from lorarl.assets.tasks import Problem, extract_answer, load_split, reward_fn

__all__ = [
    "ASSETS_DIR",
    "DATA_DIR",
    "DENSE_MODEL_DIR",
    "MODELS_DIR",
    "MOE_MODEL_DIR",
    "TASKS_DIR",
    "TOKENIZER_DIR",
    "Problem",
    "evaluate_greedy",
    "extract_answer",
    "load_split",
    "render_prompt",
    "reward_fn",
]


_LAZY = {"render_prompt": "lorarl.assets.tokenizer", "evaluate_greedy": "lorarl.assets.evaluate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lorarl.assets' has no attribute {name!r}")
