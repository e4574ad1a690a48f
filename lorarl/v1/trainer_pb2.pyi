from lorarl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LossType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_TYPE_UNSPECIFIED: _ClassVar[LossType]
    LOSS_TYPE_GRPO: _ClassVar[LossType]
    LOSS_TYPE_DR_GRPO: _ClassVar[LossType]
    LOSS_TYPE_DAPO: _ClassVar[LossType]
    LOSS_TYPE_RLOO: _ClassVar[LossType]
    LOSS_TYPE_GSPO: _ClassVar[LossType]
    LOSS_TYPE_PPO: _ClassVar[LossType]
    LOSS_TYPE_CROSS_ENTROPY: _ClassVar[LossType]
    LOSS_TYPE_IMPORTANCE_SAMPLING: _ClassVar[LossType]
    LOSS_TYPE_TOKEN_PPO: _ClassVar[LossType]
    LOSS_TYPE_OPD: _ClassVar[LossType]
    LOSS_TYPE_TOKEN_CISPO: _ClassVar[LossType]

class KlEstimator(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KL_ESTIMATOR_UNSPECIFIED: _ClassVar[KlEstimator]
    KL_ESTIMATOR_K1: _ClassVar[KlEstimator]
    KL_ESTIMATOR_K2: _ClassVar[KlEstimator]
    KL_ESTIMATOR_K3: _ClassVar[KlEstimator]

class ActivationCheckpointing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_CHECKPOINTING_UNSPECIFIED: _ClassVar[ActivationCheckpointing]
    ACTIVATION_CHECKPOINTING_AUTO: _ClassVar[ActivationCheckpointing]
    ACTIVATION_CHECKPOINTING_ON: _ClassVar[ActivationCheckpointing]
    ACTIVATION_CHECKPOINTING_OFF: _ClassVar[ActivationCheckpointing]
LOSS_TYPE_UNSPECIFIED: LossType
LOSS_TYPE_GRPO: LossType
LOSS_TYPE_DR_GRPO: LossType
LOSS_TYPE_DAPO: LossType
LOSS_TYPE_RLOO: LossType
LOSS_TYPE_GSPO: LossType
LOSS_TYPE_PPO: LossType
LOSS_TYPE_CROSS_ENTROPY: LossType
LOSS_TYPE_IMPORTANCE_SAMPLING: LossType
LOSS_TYPE_TOKEN_PPO: LossType
LOSS_TYPE_OPD: LossType
LOSS_TYPE_TOKEN_CISPO: LossType
KL_ESTIMATOR_UNSPECIFIED: KlEstimator
KL_ESTIMATOR_K1: KlEstimator
KL_ESTIMATOR_K2: KlEstimator
KL_ESTIMATOR_K3: KlEstimator
ACTIVATION_CHECKPOINTING_UNSPECIFIED: ActivationCheckpointing
ACTIVATION_CHECKPOINTING_AUTO: ActivationCheckpointing
ACTIVATION_CHECKPOINTING_ON: ActivationCheckpointing
ACTIVATION_CHECKPOINTING_OFF: ActivationCheckpointing

class LossConfig(_message.Message):
    __slots__ = ("type", "clip_eps_low", "clip_eps_high", "dual_clip", "kl_coef", "kl_estimator", "behavior_weight_cap", "max_staleness", "overlong_buffer", "overlong_penalty", "entropy_coef", "max_response_tokens", "rollout_correction", "distill_weight", "rl_weight")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_HIGH_FIELD_NUMBER: _ClassVar[int]
    DUAL_CLIP_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_WEIGHT_CAP_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_BUFFER_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_PENALTY_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    DISTILL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    type: LossType
    clip_eps_low: float
    clip_eps_high: float
    dual_clip: float
    kl_coef: float
    kl_estimator: KlEstimator
    behavior_weight_cap: float
    max_staleness: int
    overlong_buffer: int
    overlong_penalty: float
    entropy_coef: float
    max_response_tokens: int
    rollout_correction: RolloutCorrection
    distill_weight: float
    rl_weight: float
    def __init__(self, type: _Optional[_Union[LossType, str]] = ..., clip_eps_low: _Optional[float] = ..., clip_eps_high: _Optional[float] = ..., dual_clip: _Optional[float] = ..., kl_coef: _Optional[float] = ..., kl_estimator: _Optional[_Union[KlEstimator, str]] = ..., behavior_weight_cap: _Optional[float] = ..., max_staleness: _Optional[int] = ..., overlong_buffer: _Optional[int] = ..., overlong_penalty: _Optional[float] = ..., entropy_coef: _Optional[float] = ..., max_response_tokens: _Optional[int] = ..., rollout_correction: _Optional[_Union[RolloutCorrection, _Mapping]] = ..., distill_weight: _Optional[float] = ..., rl_weight: _Optional[float] = ...) -> None: ...

class RolloutCorrection(_message.Message):
    __slots__ = ("rollout_is", "rollout_is_threshold", "rollout_is_threshold_low", "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_low")
    ROLLOUT_IS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IS_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IS_THRESHOLD_LOW_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_RS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_RS_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_RS_THRESHOLD_LOW_FIELD_NUMBER: _ClassVar[int]
    rollout_is: str
    rollout_is_threshold: float
    rollout_is_threshold_low: float
    rollout_rs: str
    rollout_rs_threshold: float
    rollout_rs_threshold_low: float
    def __init__(self, rollout_is: _Optional[str] = ..., rollout_is_threshold: _Optional[float] = ..., rollout_is_threshold_low: _Optional[float] = ..., rollout_rs: _Optional[str] = ..., rollout_rs_threshold: _Optional[float] = ..., rollout_rs_threshold_low: _Optional[float] = ...) -> None: ...

class OptimizerConfig(_message.Message):
    __slots__ = ("learning_rate", "weight_decay", "beta1", "beta2", "eps", "warmup_steps", "total_steps", "max_grad_norm", "micro_batch_tokens")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    warmup_steps: int
    total_steps: int
    max_grad_norm: float
    micro_batch_tokens: int
    def __init__(self, learning_rate: _Optional[float] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., total_steps: _Optional[int] = ..., max_grad_norm: _Optional[float] = ..., micro_batch_tokens: _Optional[int] = ...) -> None: ...

class JobConfig(_message.Message):
    __slots__ = ("base_model_path", "device", "dtype", "lora", "loss", "optimizer", "full_finetune", "seed", "engine", "max_sequence_tokens", "max_buffered_trajectories", "megatron", "memory", "layer_devices", "init_adapter_path", "routing_replay", "fingerprint_check", "share", "base_model_name")
    BASE_MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    FULL_FINETUNE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BUFFERED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    MEGATRON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    LAYER_DEVICES_FIELD_NUMBER: _ClassVar[int]
    INIT_ADAPTER_PATH_FIELD_NUMBER: _ClassVar[int]
    ROUTING_REPLAY_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_CHECK_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    base_model_path: str
    device: str
    dtype: str
    lora: _common_pb2.LoraSpec
    loss: LossConfig
    optimizer: OptimizerConfig
    full_finetune: bool
    seed: int
    engine: str
    max_sequence_tokens: int
    max_buffered_trajectories: int
    megatron: MegatronConfig
    memory: MemoryConfig
    layer_devices: int
    init_adapter_path: str
    routing_replay: str
    fingerprint_check: str
    share: float
    base_model_name: str
    def __init__(self, base_model_path: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., lora: _Optional[_Union[_common_pb2.LoraSpec, _Mapping]] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., full_finetune: _Optional[bool] = ..., seed: _Optional[int] = ..., engine: _Optional[str] = ..., max_sequence_tokens: _Optional[int] = ..., max_buffered_trajectories: _Optional[int] = ..., megatron: _Optional[_Union[MegatronConfig, _Mapping]] = ..., memory: _Optional[_Union[MemoryConfig, _Mapping]] = ..., layer_devices: _Optional[int] = ..., init_adapter_path: _Optional[str] = ..., routing_replay: _Optional[str] = ..., fingerprint_check: _Optional[str] = ..., share: _Optional[float] = ..., base_model_name: _Optional[str] = ...) -> None: ...

class MemoryConfig(_message.Message):
    __slots__ = ("activation_checkpointing", "logits_chunk_tokens")
    ACTIVATION_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    LOGITS_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    activation_checkpointing: ActivationCheckpointing
    logits_chunk_tokens: int
    def __init__(self, activation_checkpointing: _Optional[_Union[ActivationCheckpointing, str]] = ..., logits_chunk_tokens: _Optional[int] = ...) -> None: ...

class MegatronConfig(_message.Message):
    __slots__ = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size")
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel_size: int
    def __init__(self, tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., expert_parallel_size: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "config", "version", "step", "buffered_trajectories", "base_model_fingerprint", "trainable_parameters", "total_parameters", "base_bytes", "base_jobs", "job_bytes", "trained_tokens", "tokens_per_second", "base_turns", "base_wait_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BASE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_JOBS_FIELD_NUMBER: _ClassVar[int]
    JOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BASE_TURNS_FIELD_NUMBER: _ClassVar[int]
    BASE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    config: JobConfig
    version: int
    step: int
    buffered_trajectories: int
    base_model_fingerprint: str
    trainable_parameters: int
    total_parameters: int
    base_bytes: int
    base_jobs: int
    job_bytes: int
    trained_tokens: float
    tokens_per_second: float
    base_turns: int
    base_wait_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., config: _Optional[_Union[JobConfig, _Mapping]] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., buffered_trajectories: _Optional[int] = ..., base_model_fingerprint: _Optional[str] = ..., trainable_parameters: _Optional[int] = ..., total_parameters: _Optional[int] = ..., base_bytes: _Optional[int] = ..., base_jobs: _Optional[int] = ..., job_bytes: _Optional[int] = ..., trained_tokens: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., base_turns: _Optional[int] = ..., base_wait_seconds: _Optional[float] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("job_id", "config", "attach")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    config: JobConfig
    attach: bool
    def __init__(self, job_id: _Optional[str] = ..., config: _Optional[_Union[JobConfig, _Mapping]] = ..., attach: _Optional[bool] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ("job", "attached")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    job: JobStatus
    attached: bool
    def __init__(self, job: _Optional[_Union[JobStatus, _Mapping]] = ..., attached: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: JobStatus
    def __init__(self, job: _Optional[_Union[JobStatus, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushTrajectoriesRequest(_message.Message):
    __slots__ = ("job_id", "trajectories")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_common_pb2.Trajectory]
    def __init__(self, job_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_common_pb2.Trajectory, _Mapping]]] = ...) -> None: ...

class PushTrajectoriesResponse(_message.Message):
    __slots__ = ("statuses", "accepted", "buffered_trajectories")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedCompositeFieldContainer[_common_pb2.ItemStatus]
    accepted: int
    buffered_trajectories: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[_common_pb2.ItemStatus, _Mapping]]] = ..., accepted: _Optional[int] = ..., buffered_trajectories: _Optional[int] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("job_id", "max_trajectories", "trajectories")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    max_trajectories: int
    trajectories: _containers.RepeatedCompositeFieldContainer[_common_pb2.Trajectory]
    def __init__(self, job_id: _Optional[str] = ..., max_trajectories: _Optional[int] = ..., trajectories: _Optional[_Iterable[_Union[_common_pb2.Trajectory, _Mapping]]] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("version", "step", "metrics")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    metrics: StepMetrics
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., metrics: _Optional[_Union[StepMetrics, _Mapping]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("job_id", "trajectories", "loss", "forward_only", "return_logprobs")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_common_pb2.Trajectory]
    loss: LossConfig
    forward_only: bool
    return_logprobs: bool
    def __init__(self, job_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_common_pb2.Trajectory, _Mapping]]] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ..., forward_only: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("metrics", "logprobs")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    metrics: StepMetrics
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, metrics: _Optional[_Union[StepMetrics, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("job_id", "learning_rate", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float
    def __init__(self, job_id: _Optional[str] = ..., learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("version", "step", "metrics")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    metrics: StepMetrics
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., metrics: _Optional[_Union[StepMetrics, _Mapping]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("job_id", "trajectories", "reference")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_common_pb2.Trajectory]
    reference: bool
    def __init__(self, job_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_common_pb2.Trajectory, _Mapping]]] = ..., reference: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, results: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "path", "keep_last")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    path: str
    keep_last: int
    def __init__(self, job_id: _Optional[str] = ..., path: _Optional[str] = ..., keep_last: _Optional[int] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "version", "step", "removed")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    step: int
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "path")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    path: str
    def __init__(self, job_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("version", "step")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("job_id", "mode", "path")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    mode: _common_pb2.SyncMode
    path: str
    def __init__(self, job_id: _Optional[str] = ..., mode: _Optional[_Union[_common_pb2.SyncMode, str]] = ..., path: _Optional[str] = ...) -> None: ...

class ExportResponse(_message.Message):
    __slots__ = ("path", "manifest")
    PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    path: str
    manifest: _common_pb2.WeightManifest
    def __init__(self, path: _Optional[str] = ..., manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("job_id", "mode", "wait_for_activation", "timeout_seconds", "skip_unpublished")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_UNPUBLISHED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    mode: _common_pb2.SyncMode
    wait_for_activation: bool
    timeout_seconds: int
    skip_unpublished: bool
    def __init__(self, job_id: _Optional[str] = ..., mode: _Optional[_Union[_common_pb2.SyncMode, str]] = ..., wait_for_activation: _Optional[bool] = ..., timeout_seconds: _Optional[int] = ..., skip_unpublished: _Optional[bool] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("manifest", "seconds", "version", "mode", "mode_reason", "duplicate", "activated", "error", "failed_replicas", "payload_bytes", "transport")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    seconds: float
    version: int
    mode: _common_pb2.SyncMode
    mode_reason: str
    duplicate: bool
    activated: bool
    error: str
    failed_replicas: _containers.RepeatedScalarFieldContainer[str]
    payload_bytes: int
    transport: str
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., seconds: _Optional[float] = ..., version: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.SyncMode, str]] = ..., mode_reason: _Optional[str] = ..., duplicate: _Optional[bool] = ..., activated: _Optional[bool] = ..., error: _Optional[str] = ..., failed_replicas: _Optional[_Iterable[str]] = ..., payload_bytes: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...
