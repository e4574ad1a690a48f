"""Where the shipped assets live, so every service and test finds them without configuration."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DATA_DIR = ASSETS_DIR / "data"
TASKS_DIR = DATA_DIR / "tasks"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
MODELS_DIR = ASSETS_DIR / "models"
DENSE_MODEL_DIR = MODELS_DIR / "qwen3-tiny"
MOE_MODEL_DIR = MODELS_DIR / "qwen3-moe-tiny"
TOOLS_MODEL_DIR = MODELS_DIR / "qwen3-tiny-tools"
#: the tool policy warm-started on the single-turn tasks too: one base for both (examples/multitenant)
MIXED_MODEL_DIR = MODELS_DIR / "qwen3-tiny-mixed"
