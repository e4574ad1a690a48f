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


def write_jsonl_splits(out_dir: Path, lines: dict[str, list[str]]) -> dict[str, Path]:
    """``<split>.jsonl`` under ``out_dir`` for each split's JSON lines; returns their paths (every shipped split
    folder is written this way, so a rebuild leaves the files byte-identical)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in lines.items():
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(row + "\n" for row in rows))
        paths[split] = path
    return paths
