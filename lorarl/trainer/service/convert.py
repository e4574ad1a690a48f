"""Protobuf <-> plain Python for the trainer: the only place that knows both worlds.

The training spec's proto form, zeros and presence included, is lorarl.contract.training's; this module
puts a SpecError under the request's field (INVALID_ARGUMENT ``config.optimizer.learning_rate``) and
converts trajectories and metrics.
"""

from __future__ import annotations

from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.errors import SpecError
from lorarl.contract.routes import RoutedExperts, RoutesError
from lorarl.contract.training import LossSpec, TrainingSpec
from lorarl.trainer.engines.api import TrajectoryRecord
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.v1 import common_pb2, trainer_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


def _invalid(prefix: str, error: SpecError) -> InvalidArgumentError:
    return InvalidArgumentError(f"{prefix}.{error.path}", error.problem)


def loss_spec(cfg: trainer_pb2.LossConfig, field: str = "config.loss") -> LossSpec:
    """A request's loss (a step's override: ``field`` "loss"), INVALID_ARGUMENT under ``field``."""
    try:
        return LossSpec.from_proto(cfg)
    except SpecError as e:
        raise InvalidArgumentError(f"{field}.{e.field}", e.problem) from None


def job_spec(cfg: trainer_pb2.JobConfig, default_device: str) -> TrainingSpec:
    """JobConfig -> TrainingSpec; every bad value is INVALID_ARGUMENT naming its field."""
    try:
        return TrainingSpec.from_proto(cfg, default_device, lora_type=LoraConfig)
    except SpecError as e:
        raise _invalid("config", e) from None


def job_config(spec: TrainingSpec) -> trainer_pb2.JobConfig:
    """TrainingSpec -> JobConfig with every default made explicit (what the job really runs with)."""
    return spec.to_proto()


def trajectory_record(t: common_pb2.Trajectory) -> TrajectoryRecord:
    """The plain record; routes that cannot be read are kept as the problem, which validation reports under
    the trajectory's own index (one bad trajectory never fails the others of its request)."""
    routes, problem = None, None
    if t.HasField("routed_experts"):
        try:
            routes = RoutedExperts.from_proto(t.routed_experts)
        except RoutesError as e:
            problem = (e.field, e.problem)
    return TrajectoryRecord(
        prompt_token_ids=list(t.prompt_token_ids), completion_token_ids=list(t.completion_token_ids),
        behavior_logprobs=list(t.behavior_logprobs), token_versions=list(t.token_versions), reward=t.reward,
        group_id=t.group_id, finish_reason=FINISH_REASONS.get(t.finish_reason, "?"), id=t.id,
        loss_mask=list(t.loss_mask) or None, turn_rewards=list(t.turn_rewards),
        token_advantages=list(t.token_advantages) or None, routes=routes, routes_problem=problem,
        fingerprints=dict(t.policy_fingerprints), teacher_logprobs=list(t.teacher_logprobs) or None,
        teacher=t.teacher,
    )


def step_metrics(values: dict[str, float]) -> trainer_pb2.StepMetrics:
    return trainer_pb2.StepMetrics(values={k: float(v) for k, v in values.items()})
