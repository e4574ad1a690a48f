"""Models and adapters for rollout tests: the shipped tiny policies when present, else random-init ones."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from lorarl.assets.paths import DENSE_MODEL_DIR, MOE_MODEL_DIR
from lorarl.contract.lora import LoraSpec
from lorarl.rollout.model_files import ModelFiles

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA = LoraSpec(rank=8, alpha=16.0, target_modules=())
#: "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n" in the shipped tokenizer's ids.
PROMPT = (257, 260, 10, *b"12+34=", 258, 10, 257, 261, 10)


def _shipped(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _model_dir(shipped: Path, shape: str) -> Path:
    """The shipped model, or a random-init one of the same shape (built once per machine, fp32)."""
    if _shipped(shipped):
        return shipped
    from lorarl.assets.models import build_random_model

    out = Path(tempfile.gettempdir()) / "lorarl-rollout-tests" / shape
    if not _shipped(out):
        build_random_model(shape, out, dtype=torch.float32)
    return out


def dense_model_dir() -> Path:
    return _model_dir(DENSE_MODEL_DIR, "qwen3-tiny")


def moe_model_dir() -> Path:
    return _model_dir(MOE_MODEL_DIR, "qwen3-moe-tiny")


def random_adapter(model_dir: Path, rank: int = 8, seed: int = 1, std: float = 0.1,
                   targets: tuple[str, ...] = ALL_LINEAR) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors for every 2-D weight whose module is in `targets` (experts excluded)."""
    files = ModelFiles(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in files.weight_names():
        module, _, leaf = name.removesuffix(".weight").rpartition(".")
        shape = files.shape(name)
        if leaf not in targets or ".experts." in name or shape is None or len(shape) != 2:
            continue
        prefix = f"base_model.model.{module}.{leaf}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, shape[1], generator=g) * std
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(shape[0], rank, generator=g) * std
    return tensors
