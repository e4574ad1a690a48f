"""Shared builders for engine tests: job specs on tiny checkpoints and synthetic trajectory batches."""

from __future__ import annotations

import os
import random
from pathlib import Path

from lorarl.trainer.engines.api import OptimizerSpec, TrainingSpec, TrajectoryRecord
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.rl.losses import LossSpec

#: Engine tests run on CPU; set LORARL_TEST_DEVICE=cuda to run the same tests on a GPU.
DEVICE = os.environ.get("LORARL_TEST_DEVICE", "cpu")


def make_spec(path: Path, *, lr: float = 1e-2, micro_batch_tokens: int = 0, loss: LossSpec | None = None,
              lora: LoraConfig | None = None, **kwargs: object) -> TrainingSpec:
    optimizer = OptimizerSpec(learning_rate=lr, micro_batch_tokens=micro_batch_tokens,
                                  **kwargs.pop("optimizer", {}))  # type: ignore[arg-type]
    kwargs.setdefault("device", DEVICE)
    return TrainingSpec(base_model_path=str(path), lora=lora or LoraConfig(rank=4, alpha=8), loss=loss or LossSpec(),
                   optimizer=optimizer, **kwargs)  # type: ignore[arg-type]


def synthetic_batch(seed: int, groups: int = 3, group_size: int = 3, vocab: int = 97, version: int = 0,
                    max_version: int | None = None) -> list[TrajectoryRecord]:
    """Groups of completions of one prompt each, with varied lengths, rewards and token versions."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 6))]
        for _ in range(group_size):
            n = rng.randint(2, 9)
            top = version if max_version is None else max_version
            versions = [rng.randint(max(0, top - 3), top) for _ in range(n)] if max_version is not None \
                else [version] * n
            out.append(TrajectoryRecord(prompt, [rng.randrange(1, vocab) for _ in range(n)],
                                        [-rng.uniform(1.0, 6.0) for _ in range(n)], versions,
                                        float(rng.randint(0, 3)), f"g{seed}-{g}"))
    return out


def count_calls(obj: object, name: str) -> list[int]:
    """Replaces ``obj.name`` with a wrapper counting its calls; the one-element list holds the count."""
    calls = [0]
    original = getattr(obj, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(obj, name, counted)
    return calls
