"""Decoupled PPO reads its proximal logprobs off the with-grad forward when nothing is random.

The proximal policy is the policy before this update; without dropout the training forward computes
exactly its logprobs, so the engine skips the extra no-grad pass. It must train exactly what the
extra pass trains, and fall back to the pass whenever dropout makes the two forwards differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorarl.trainer.engines.api import OptimizerSpec
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.rl.losses import LossSpec
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch

DECOUPLED = LossSpec(behavior_weight_cap=5.0, max_staleness=3)


def train(path: Path, reuse: bool, steps: int = 3) -> tuple[list[dict[str, float]], dict[str, torch.Tensor], int]:
    engine = TorchEngine.create(make_spec(path, loss=DECOUPLED, seed=3, micro_batch_tokens=40))
    passes = 0
    original = engine.rl.logprobs_no_grad

    def counted(*args, **kwargs):
        nonlocal passes
        passes += 1
        return original(*args, **kwargs)

    engine.rl.logprobs_no_grad = counted  # type: ignore[method-assign]
    if not reuse:
        engine.dropout_free = lambda: False  # type: ignore[method-assign]
    history = []
    for step in range(steps):
        batch = synthetic_batch(step, groups=3, group_size=3, max_version=engine.version)
        history.append(engine.train_step(batch))
    adapters = {n: p.detach().clone() for n, p in engine.named_trainable_parameters().items()}
    return history, adapters, passes


@pytest.mark.parametrize("model", ["dense_dir", "moe_dir"])
def test_reused_proximal_trains_exactly_what_the_extra_pass_trains(model: str, request) -> None:
    path = request.getfixturevalue(model)
    reused, adapters_reused, passes_reused = train(path, reuse=True)
    extra, adapters_extra, passes_extra = train(path, reuse=False)
    assert passes_reused == 0 and passes_extra > 0
    for a, b in zip(reused, extra, strict=True):
        for key in ("loss", "pg_loss", "importance_weight_mean", "clip_fraction", "ratio_mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    for name, tensor in adapters_reused.items():
        torch.testing.assert_close(tensor, adapters_extra[name], rtol=0, atol=1e-7)


def test_dropout_keeps_the_separate_proximal_pass(dense_dir: Path) -> None:
    spec = make_spec(dense_dir, loss=DECOUPLED, lora=LoraConfig(rank=4, alpha=8, dropout=0.1))
    engine = TorchEngine.create(spec)
    assert not engine.dropout_free()
    assert TorchEngine.create(make_spec(dense_dir, loss=DECOUPLED)).dropout_free()
    assert OptimizerSpec().max_grad_norm > 0  # clipping stays on in the comparison above
