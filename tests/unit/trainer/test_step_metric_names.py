"""What a run logs of each trainer step (lorarl.client.rl.metric_names): the policy's entropy at the sampled
tokens every step, and the KL to the reference as train/kl_ref exactly when the loss has a KL term."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lorarl.client.rl.metric_names import ENTROPY, KL_REF, MISMATCH, train_metrics
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.losses import LossSpec
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.tiny import randomize_adapters


@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["no-kl-term", "kl-term"])
def test_a_step_logs_entropy_and_the_kl_to_the_reference_when_the_loss_has_one(dense_dir: Path,
                                                                               kl_coef: float) -> None:
    engine = TorchEngine(make_spec(dense_dir, loss=LossSpec(type="grpo", kl_coef=kl_coef)))
    randomize_adapters(engine.model)  # the policy away from the reference (adapters off): a KL above 0
    logged = train_metrics(engine.train_step(synthetic_batch(3)))
    # the tiny model's vocabulary is ~100 tokens: the entropy of a near-uniform policy is near log(100)
    assert 0 < logged[ENTROPY] <= math.log(engine.vocab_size) + 1e-6
    assert MISMATCH in logged  # the rollout-vs-trainer KL is another metric, always there
    assert "train/kl" not in logged
    if kl_coef:
        assert logged[KL_REF] > 0
    else:
        assert KL_REF not in logged  # no reference pass without a KL term: nothing to report
