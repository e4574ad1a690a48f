"""What the rollout service reads straight from a model directory, without loading the model.

The pristine base weights stay on disk (safetensors are memory-mapped on demand): merged payloads
that only carry some tensors are completed from them, local merges start from them, and payload
names and shapes are checked against their headers before anything reaches the engine.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


class ModelFiles:
    """config.json, generation_config.json and safetensors headers of one model directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        config_path = self.root / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{self.root} has no config.json")
        self.config: dict[str, Any] = json.loads(config_path.read_text())
        generation = self.root / "generation_config.json"
        self.generation_config: dict[str, Any] = json.loads(generation.read_text()) if generation.is_file() else {}
        self.files = sorted(self.root.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"{self.root} has no *.safetensors weights")

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config.get("text_config", self.config)

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or [self.config.get("model_type", "unknown")])[0]

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def is_moe(self) -> bool:
        cfg = self.text_config
        return bool(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", self.text_config.get("tie_word_embeddings", False)))

    @property
    def max_position_embeddings(self) -> int:
        return int(self.text_config.get("max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for source in (self.generation_config, self.config):
            value = source.get("eos_token_id")
            for tok in value if isinstance(value, list) else [value]:
                if isinstance(tok, int) and tok not in ids:
                    ids.append(tok)
        return tuple(ids)

    @cached_property
    def _index(self) -> dict[str, tuple[Path, dict[str, Any]]]:
        index: dict[str, tuple[Path, dict[str, Any]]] = {}
        for file in self.files:
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    index[name] = (file, info)
        return index

    def payload_limit(self) -> int:
        """The most bytes a weight payload for this model may declare: every weight in fp32, plus 64 MiB
        for manifests of adapters on top (a LoadWeights stream is refused above it before any allocation)."""
        return sum(4 * math.prod(info["shape"]) for _, info in self._index.values()) + (64 << 20)

    def weight_names(self) -> list[str]:
        return sorted(self._index)

    def shape(self, name: str) -> tuple[int, ...] | None:
        entry = self._index.get(name)
        return tuple(entry[1]["shape"]) if entry else None

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._index[name][1]["dtype"]]

    def tensor(self, name: str) -> torch.Tensor:
        """The pristine base tensor `name` (a fresh copy, safe to keep or modify)."""
        from safetensors import safe_open

        file, _ = self._index[name]
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name)

    def tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for `names` (default: all), one file opened at a time."""
        from safetensors import safe_open

        wanted = self.weight_names() if names is None else names
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self._index[name][0], []).append(name)
        for file, file_names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in file_names:
                    yield name, f.get_tensor(name)

    def fingerprint(self) -> str:
        """The trainer's fingerprint of this base model, so adapters are never applied to another."""
        from lorarl.contract.fingerprint import base_model_fingerprint

        return base_model_fingerprint(self.root)
