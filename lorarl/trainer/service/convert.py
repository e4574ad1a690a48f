"""Protobuf <-> plain Python for the trainer: the only place that knows both worlds.

Proto3 scalars have no presence, so a zero means "the default" wherever zero is not a meaningful
setting (learning rate, clip ranges, betas, eps); every other zero is taken as is. Where unset must
differ from zero the field is `optional` and read by presence: `max_grad_norm` (unset 1.0, 0 no
clipping) and `loss.max_staleness` (unset: no masking, 0: current version only).
Invalid values surface as InvalidArgumentError naming the request field.
"""

from __future__ import annotations

from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.enums import KL_ESTIMATORS, KL_NAMES, LOSS_NAMES, LOSS_TYPES
from lorarl.trainer.engines.api import (
    JobSpec,
    Limits,
    MegatronSettings,
    MemorySettings,
    OptimizerSettings,
    TrajectoryRecord,
)
from lorarl.trainer.engines.recompute import DEFAULT_LOGITS_CHUNK_TOKENS
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.rl.losses import LossSettings
from lorarl.v1 import common_pb2, trainer_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
DAPO_EPS_HIGH = 0.28


def _or(value: float, default: float) -> float:
    return value if value else default


def _build(field: str, factory, *args, **kwargs):
    """Builds a settings object, turning its ValueError into INVALID_ARGUMENT under ``field``."""
    try:
        return factory(*args, **kwargs)
    except ValueError as e:
        raise InvalidArgumentError(field, str(e)) from None


def lora_config(spec: common_pb2.LoraSpec, field: str = "config.lora") -> LoraConfig:
    """The spec to train by (lorarl.contract.lora: zeros are unset), INVALID_ARGUMENT under ``field``."""
    return _build(field, LoraConfig.from_proto, spec)


def loss_settings(cfg: trainer_pb2.LossConfig, field: str = "config.loss") -> LossSettings:
    if cfg.type not in LOSS_NAMES:
        raise InvalidArgumentError(f"{field}.type", f"unknown loss type {cfg.type}")
    if cfg.kl_estimator not in KL_NAMES:
        raise InvalidArgumentError(f"{field}.kl_estimator", f"unknown estimator {cfg.kl_estimator}")
    name = LOSS_NAMES[cfg.type]
    return _build(
        field, LossSettings, name=name,
        clip_eps_low=_or(cfg.clip_eps_low, 0.2),
        clip_eps_high=_or(cfg.clip_eps_high, DAPO_EPS_HIGH if name == "dapo" else 0.2),
        dual_clip=cfg.dual_clip, kl_coef=cfg.kl_coef, kl_estimator=KL_NAMES[cfg.kl_estimator],
        behavior_weight_cap=cfg.behavior_weight_cap,
        max_staleness=cfg.max_staleness if cfg.HasField("max_staleness") else None,
        overlong_buffer=cfg.overlong_buffer, overlong_penalty=cfg.overlong_penalty,
        max_response_tokens=cfg.max_response_tokens, entropy_coef=cfg.entropy_coef,
    )


def optimizer_settings(cfg: trainer_pb2.OptimizerConfig, field: str = "config.optimizer") -> OptimizerSettings:
    return _build(field, OptimizerSettings, learning_rate=_or(cfg.learning_rate, 1e-5),
                  weight_decay=cfg.weight_decay, beta1=_or(cfg.beta1, 0.9), beta2=_or(cfg.beta2, 0.999),
                  eps=_or(cfg.eps, 1e-8), warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps,
                  max_grad_norm=cfg.max_grad_norm if cfg.HasField("max_grad_norm") else 1.0,
                  micro_batch_tokens=cfg.micro_batch_tokens)


def megatron_settings(cfg: trainer_pb2.MegatronConfig, field: str = "config.megatron") -> MegatronSettings:
    return _build(field, MegatronSettings, tensor_parallel_size=cfg.tensor_parallel_size or 1,
                  pipeline_parallel_size=cfg.pipeline_parallel_size or 1,
                  expert_parallel_size=cfg.expert_parallel_size or 1)


CHECKPOINTING_NAMES = {
    trainer_pb2.ACTIVATION_CHECKPOINTING_UNSPECIFIED: "auto",
    trainer_pb2.ACTIVATION_CHECKPOINTING_AUTO: "auto",
    trainer_pb2.ACTIVATION_CHECKPOINTING_ON: "on",
    trainer_pb2.ACTIVATION_CHECKPOINTING_OFF: "off",
}
CHECKPOINTING_VALUES = {name: value for value, name in CHECKPOINTING_NAMES.items() if value}


def memory_settings(cfg: trainer_pb2.MemoryConfig, field: str = "config.memory") -> MemorySettings:
    if cfg.activation_checkpointing not in CHECKPOINTING_NAMES:
        raise InvalidArgumentError(f"{field}.activation_checkpointing",
                                   f"unknown value {cfg.activation_checkpointing} (use AUTO, ON or OFF)")
    chunk = cfg.logits_chunk_tokens if cfg.HasField("logits_chunk_tokens") else DEFAULT_LOGITS_CHUNK_TOKENS
    return _build(field, MemorySettings, activation_checkpointing=CHECKPOINTING_NAMES[cfg.activation_checkpointing],
                  logits_chunk_tokens=chunk)


def job_spec(cfg: trainer_pb2.JobConfig, default_device: str) -> JobSpec:
    """JobConfig -> JobSpec; every bad value is INVALID_ARGUMENT naming its field."""
    if not cfg.base_model_path:
        raise InvalidArgumentError("config.base_model_path", "is required (a local Hugging Face model directory)")
    limits = _build("config", Limits, max_sequence_tokens=cfg.max_sequence_tokens or 4096,
                    max_buffered_trajectories=cfg.max_buffered_trajectories or 4096)
    return _build(
        "config", JobSpec, base_model_path=cfg.base_model_path, device=cfg.device or default_device,
        dtype=cfg.dtype or "float32", lora=lora_config(cfg.lora), loss=loss_settings(cfg.loss),
        optimizer=optimizer_settings(cfg.optimizer), full_finetune=cfg.full_finetune, seed=cfg.seed,
        engine=cfg.engine or "torch", limits=limits, megatron=megatron_settings(cfg.megatron),
        memory=memory_settings(cfg.memory), layer_devices=cfg.layer_devices or 1,
        init_adapter_path=cfg.init_adapter_path,
    )


def job_config(spec: JobSpec) -> trainer_pb2.JobConfig:
    """JobSpec -> JobConfig with every default made explicit (what the job really runs with)."""
    loss, opt = spec.loss, spec.optimizer
    return trainer_pb2.JobConfig(
        base_model_path=spec.base_model_path, device=spec.device, dtype=spec.dtype, lora=spec.lora.to_proto(),
        loss=trainer_pb2.LossConfig(
            type=LOSS_TYPES[loss.name], clip_eps_low=loss.clip_eps_low, clip_eps_high=loss.clip_eps_high,
            dual_clip=loss.dual_clip, kl_coef=loss.kl_coef,
            kl_estimator=KL_ESTIMATORS[loss.kl_estimator],
            behavior_weight_cap=loss.behavior_weight_cap, max_staleness=loss.max_staleness,
            overlong_buffer=loss.overlong_buffer, overlong_penalty=loss.overlong_penalty,
            max_response_tokens=loss.max_response_tokens, entropy_coef=loss.entropy_coef),
        optimizer=trainer_pb2.OptimizerConfig(
            learning_rate=opt.learning_rate, weight_decay=opt.weight_decay, beta1=opt.beta1, beta2=opt.beta2,
            eps=opt.eps, warmup_steps=opt.warmup_steps, total_steps=opt.total_steps,
            max_grad_norm=opt.max_grad_norm, micro_batch_tokens=opt.micro_batch_tokens),
        full_finetune=spec.full_finetune, seed=spec.seed, engine=spec.engine,
        max_sequence_tokens=spec.limits.max_sequence_tokens,
        max_buffered_trajectories=spec.limits.max_buffered_trajectories,
        megatron=trainer_pb2.MegatronConfig(
            tensor_parallel_size=spec.megatron.tensor_parallel_size,
            pipeline_parallel_size=spec.megatron.pipeline_parallel_size,
            expert_parallel_size=spec.megatron.expert_parallel_size),
        memory=trainer_pb2.MemoryConfig(
            activation_checkpointing=CHECKPOINTING_VALUES[spec.memory.activation_checkpointing],
            logits_chunk_tokens=spec.memory.logits_chunk_tokens),
        layer_devices=spec.layer_devices, init_adapter_path=spec.init_adapter_path,
    )


def trajectory_record(t: common_pb2.Trajectory) -> TrajectoryRecord:
    return TrajectoryRecord(
        prompt_token_ids=list(t.prompt_token_ids), completion_token_ids=list(t.completion_token_ids),
        behavior_logprobs=list(t.behavior_logprobs), token_versions=list(t.token_versions), reward=t.reward,
        group_id=t.group_id, finish_reason=FINISH_REASONS.get(t.finish_reason, "?"), id=t.id,
        loss_mask=list(t.loss_mask) or None, turn_rewards=list(t.turn_rewards),
    )


def step_metrics(values: dict[str, float]) -> trainer_pb2.StepMetrics:
    return trainer_pb2.StepMetrics(values={k: float(v) for k, v in values.items()})
