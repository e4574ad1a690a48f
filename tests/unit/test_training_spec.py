"""The training spec (lorarl.contract.training): one set of defaults and bounds, whichever surface a job
comes through — the job file, the gRPC JobConfig, the SDK — and a proto form that keeps what was asked."""

from __future__ import annotations

import dataclasses

import pytest

from lorarl.client.job.config import JobFileConfig, load_job_config, training_spec
from lorarl.common.config import ConfigError
from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.errors import SpecError
from lorarl.contract.lora import MAX_RANK, VLLM_LORA_RANKS, serving_rank
from lorarl.contract.training import (
    DAPO_CLIP_EPS_HIGH,
    DEFAULT_LEARNING_RATE,
    STALE_WEIGHT_CAP,
    LossSpec,
    OptimizerSpec,
    TrainingSpec,
)
from lorarl.trainer.service.convert import job_config, job_spec, loss_spec
from lorarl.v1 import trainer_pb2

EXAMPLE = "examples/demo.yaml"


def job(*overrides: str) -> JobFileConfig:
    return load_job_config(None, list(overrides))


def test_the_job_file_and_the_wire_default_to_the_same_spec() -> None:
    cfg = job()
    from_file = training_spec(cfg, "/models/m")
    over_grpc = job_spec(trainer_pb2.JobConfig(base_model_path="/models/m"), default_device="cpu")
    assert cfg.trainer.optimizer == OptimizerSpec() == over_grpc.optimizer
    assert from_file.optimizer.learning_rate == over_grpc.optimizer.learning_rate == DEFAULT_LEARNING_RATE
    assert from_file.memory == over_grpc.memory and from_file.lora.to_proto() == over_grpc.lora.to_proto()
    assert from_file.limits == over_grpc.limits  # the demo's prompts and completions fit the default limit
    assert from_file.loss.type == over_grpc.loss.type and from_file.loss.upper_clip == over_grpc.loss.upper_clip


@pytest.mark.parametrize(("override", "key"), [
    ("trainer.optimizer.learning_rate=-1", "trainer.optimizer.learning_rate"),
    ("trainer.optimizer.learning_rate=11", "trainer.optimizer.learning_rate"),
    ("trainer.optimizer.beta2=1.0", "trainer.optimizer.beta2"),
    ("trainer.loss.clip_eps_low=1.5", "trainer.loss.clip_eps_low"),
    ("trainer.loss.dual_clip=0.5", "trainer.loss.dual_clip"),
    ("trainer.loss.behavior_weight_cap=-1", "trainer.loss.behavior_weight_cap"),
    ("trainer.memory.logits_chunk_tokens=-1", "trainer.memory.logits_chunk_tokens"),
    (f"trainer.lora.rank={MAX_RANK + 1}", "trainer.lora.rank"),
])
def test_one_bound_refused_alike_by_the_job_file_and_over_grpc(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as in_file:
        job(override)
    assert in_file.value.key == key
    section, field = key.split(".")[1:]
    value = float(override.split("=")[1])
    proto = trainer_pb2.JobConfig(base_model_path="/m")
    target = getattr(proto, section)
    if field in ("rank", "logits_chunk_tokens"):
        if value < 0:
            return  # an unsigned proto field: the wire cannot carry it
        value = int(value)
    setattr(target, field, value)
    with pytest.raises(InvalidArgumentError) as over_grpc:
        job_spec(proto, default_device="cpu")
    assert over_grpc.value.field == f"config.{section}.{field}"


def test_a_spec_error_names_its_path_and_problem() -> None:
    with pytest.raises(SpecError) as raised:
        OptimizerSpec(learning_rate=-1.0)
    assert (raised.value.field, raised.value.path) == ("learning_rate", "optimizer.learning_rate")
    assert str(raised.value) == "optimizer.learning_rate must be in (0, 10], got -1.0"


def test_dapo_defaults_to_clip_higher_on_every_surface() -> None:
    assert LossSpec(type="dapo").upper_clip == DAPO_CLIP_EPS_HIGH and LossSpec().upper_clip == 0.2
    assert training_spec(job("trainer.loss.type=dapo"), "/m").loss.upper_clip == DAPO_CLIP_EPS_HIGH
    assert loss_spec(trainer_pb2.LossConfig(type=trainer_pb2.LOSS_TYPE_DAPO)).upper_clip == DAPO_CLIP_EPS_HIGH
    assert training_spec(job("trainer.loss.type=dapo", "trainer.loss.clip_eps_high=0.25"), "/m").loss.upper_clip \
        == 0.25


def test_the_weight_cap_rule_is_stated_once_and_zero_turns_it_off() -> None:
    """Unset: capped at STALE_WEIGHT_CAP when tokens may be stale (an async loop), else off; 0 is off."""
    async_loop = training_spec(job("loop.mode=async", "loop.max_staleness=2"), "/m").loss
    assert (async_loop.max_staleness, async_loop.weight_cap) == (2, STALE_WEIGHT_CAP)
    assert training_spec(job("loop.mode=sync"), "/m").loss.weight_cap == 0.0
    off = training_spec(job("loop.mode=async", "trainer.loss.behavior_weight_cap=0"), "/m")
    assert off.loss.weight_cap == 0.0
    # ... and stays off over the wire, where a zero would otherwise read as unset.
    assert job_spec(off.to_proto(), default_device="cpu").loss.weight_cap == 0.0
    assert job_spec(async_loop and training_spec(job("loop.mode=async"), "/m").to_proto(),
                    default_device="cpu").loss.weight_cap == STALE_WEIGHT_CAP


@pytest.mark.parametrize("staleness", [None, 0, 2])
@pytest.mark.parametrize("grad_norm", [None, 0.0, 0.25])
@pytest.mark.parametrize("cap", [None, 0.0, 3.0])
def test_the_effective_job_config_round_trips_presence(staleness: int | None, grad_norm: float | None,
                                                        cap: float | None) -> None:
    """GetJob reports what the job runs with: an unset bound stays unset, a zero stays zero (the wire's floats
    are 32-bit, so the fixed point is the proto's)."""
    config = trainer_pb2.JobConfig(base_model_path="/models/m",
                                   loss=trainer_pb2.LossConfig(max_staleness=staleness, behavior_weight_cap=cap),
                                   optimizer=trainer_pb2.OptimizerConfig(max_grad_norm=grad_norm))
    spec = job_spec(config, default_device="cpu")
    again = job_spec(job_config(spec), default_device="cpu")
    assert job_config(again) == job_config(spec)
    assert again.loss.max_staleness == staleness and again.loss.behavior_weight_cap == cap
    assert again.optimizer.max_grad_norm == (1.0 if grad_norm is None else grad_norm)
    assert job_config(spec).loss.HasField("max_staleness") == (staleness is not None)


def test_a_spec_from_the_job_file_reaches_the_trainer_unchanged() -> None:
    cfg = load_job_config(EXAMPLE, ["trainer.loss.kl_coef=0.01", "trainer.optimizer.total_steps=7",
                                    "trainer.memory.activation_checkpointing=on"])
    spec = training_spec(cfg, "/models/m")
    received = TrainingSpec.from_proto(spec.to_proto())
    assert received.to_proto() == spec.to_proto()
    assert (received.loss.kl_coef, received.optimizer.total_steps, received.memory.activation_checkpointing) == \
        (pytest.approx(0.01), 7, "on")
    assert received.optimizer.learning_rate == pytest.approx(0.002) == cfg.trainer.optimizer.learning_rate
    assert received.loss.max_response_tokens == cfg.rollout.max_tokens


def test_the_rollout_rank_follows_the_trainer_rank_unless_set() -> None:
    assert [serving_rank(r) for r in (1, 2, 16, 17, 300, 512)] == [1, 8, 16, 32, 320, 512]
    assert job("trainer.lora.rank=24").serving_lora_rank == 32
    assert job("trainer.lora.rank=24", "rollout.max_lora_rank=64").serving_lora_rank == 64
    with pytest.raises(ConfigError, match=r"rollout\.max_lora_rank: 16 is below trainer\.lora\.rank=24"):
        job("trainer.lora.rank=24", "rollout.max_lora_rank=16")
    with pytest.raises(ConfigError, match="expected 0 or one of"):
        job("rollout.max_lora_rank=24")


def test_vllm_takes_the_ranks_the_contract_lists() -> None:
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    assert tuple(get_args(MaxLoRARanks)) == VLLM_LORA_RANKS and max(VLLM_LORA_RANKS) == MAX_RANK


def test_a_checkpoint_from_before_the_spec_still_exports() -> None:
    from lorarl.trainer.engines.offline_export import loss_from_manifest

    assert loss_from_manifest({"name": "dapo", "clip_eps_low": 0.2}) == LossSpec(type="dapo", clip_eps_low=0.2)
    assert dataclasses.asdict(LossSpec())["type"] == "grpo"
