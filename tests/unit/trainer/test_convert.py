"""Trainer proto <-> plain conversions where unset must differ from zero (optional proto fields)."""

from __future__ import annotations

import pytest

from lorarl.common.errors import InvalidArgumentError
from lorarl.trainer.service.convert import job_config, job_spec, loss_settings, optimizer_settings
from lorarl.v1 import trainer_pb2


def test_max_grad_norm_unset_is_the_default_and_zero_turns_clipping_off() -> None:
    assert optimizer_settings(trainer_pb2.OptimizerConfig()).max_grad_norm == 1.0
    assert optimizer_settings(trainer_pb2.OptimizerConfig(max_grad_norm=0.0)).max_grad_norm == 0.0
    assert optimizer_settings(trainer_pb2.OptimizerConfig(max_grad_norm=0.5)).max_grad_norm == 0.5


def test_max_staleness_unset_masks_nothing_and_zero_keeps_only_the_current_version() -> None:
    assert loss_settings(trainer_pb2.LossConfig()).max_staleness is None
    assert loss_settings(trainer_pb2.LossConfig(max_staleness=0)).max_staleness == 0
    assert loss_settings(trainer_pb2.LossConfig(max_staleness=3)).max_staleness == 3


@pytest.mark.parametrize("staleness", [None, 0, 2])
@pytest.mark.parametrize("grad_norm", [None, 0.0, 0.25])
def test_the_effective_job_config_round_trips_presence(staleness: int | None, grad_norm: float | None) -> None:
    """GetJob reports what the job runs with: an unset bound stays unset, a zero stays zero."""
    config = trainer_pb2.JobConfig(base_model_path="/models/m", loss=trainer_pb2.LossConfig(max_staleness=staleness),
                                   optimizer=trainer_pb2.OptimizerConfig(max_grad_norm=grad_norm))
    spec = job_spec(config, default_device="cpu")
    again = job_spec(job_config(spec), default_device="cpu")
    assert again.loss.max_staleness == staleness
    assert again.optimizer.max_grad_norm == (1.0 if grad_norm is None else grad_norm)
    assert job_config(spec).loss.HasField("max_staleness") == (staleness is not None)


def test_a_negative_grad_norm_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError, match="max_grad_norm must be >= 0") as raised:
        optimizer_settings(trainer_pb2.OptimizerConfig(max_grad_norm=-1.0))
    assert raised.value.field == "config.optimizer"
