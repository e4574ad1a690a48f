import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    D_TYPE_UNSPECIFIED: _ClassVar[DType]
    D_TYPE_FLOAT32: _ClassVar[DType]
    D_TYPE_BFLOAT16: _ClassVar[DType]
    D_TYPE_FLOAT16: _ClassVar[DType]
    D_TYPE_INT64: _ClassVar[DType]
    D_TYPE_INT32: _ClassVar[DType]
    D_TYPE_UINT8: _ClassVar[DType]

class SyncMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_MODE_UNSPECIFIED: _ClassVar[SyncMode]
    SYNC_MODE_ADAPTER: _ClassVar[SyncMode]
    SYNC_MODE_MERGED: _ClassVar[SyncMode]
    SYNC_MODE_AUTO: _ClassVar[SyncMode]

class ExpertAdapterMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPERT_ADAPTER_MODE_UNSPECIFIED: _ClassVar[ExpertAdapterMode]
    EXPERT_ADAPTER_MODE_NONE: _ClassVar[ExpertAdapterMode]
    EXPERT_ADAPTER_MODE_PER_EXPERT: _ClassVar[ExpertAdapterMode]
    EXPERT_ADAPTER_MODE_SHARED: _ClassVar[ExpertAdapterMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class CollectiveBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLLECTIVE_BACKEND_UNSPECIFIED: _ClassVar[CollectiveBackend]
    COLLECTIVE_BACKEND_GLOO: _ClassVar[CollectiveBackend]
    COLLECTIVE_BACKEND_NCCL: _ClassVar[CollectiveBackend]
    COLLECTIVE_BACKEND_HCCL: _ClassVar[CollectiveBackend]
D_TYPE_UNSPECIFIED: DType
D_TYPE_FLOAT32: DType
D_TYPE_BFLOAT16: DType
D_TYPE_FLOAT16: DType
D_TYPE_INT64: DType
D_TYPE_INT32: DType
D_TYPE_UINT8: DType
SYNC_MODE_UNSPECIFIED: SyncMode
SYNC_MODE_ADAPTER: SyncMode
SYNC_MODE_MERGED: SyncMode
SYNC_MODE_AUTO: SyncMode
EXPERT_ADAPTER_MODE_UNSPECIFIED: ExpertAdapterMode
EXPERT_ADAPTER_MODE_NONE: ExpertAdapterMode
EXPERT_ADAPTER_MODE_PER_EXPERT: ExpertAdapterMode
EXPERT_ADAPTER_MODE_SHARED: ExpertAdapterMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
COLLECTIVE_BACKEND_UNSPECIFIED: CollectiveBackend
COLLECTIVE_BACKEND_GLOO: CollectiveBackend
COLLECTIVE_BACKEND_NCCL: CollectiveBackend
COLLECTIVE_BACKEND_HCCL: CollectiveBackend

class LoraSpec(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "target_modules", "expert_mode", "use_rslora")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MODE_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    expert_mode: ExpertAdapterMode
    use_rslora: bool
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., expert_mode: _Optional[_Union[ExpertAdapterMode, str]] = ..., use_rslora: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "logprobs", "stop_token_ids", "ignore_eos", "prompt_logprobs")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    prompt_logprobs: bool
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("id", "job_id", "group_id", "prompt_token_ids", "completion_token_ids", "behavior_logprobs", "token_versions", "reward", "rewards", "finish_reason", "metrics", "loss_mask", "turn_rewards", "token_advantages", "routed_experts", "policy_fingerprints", "teacher_logprobs", "teacher")
    class RewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PolicyFingerprintsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    group_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    behavior_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    rewards: _containers.ScalarMap[str, float]
    finish_reason: FinishReason
    metrics: _containers.ScalarMap[str, float]
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    token_advantages: _containers.RepeatedScalarFieldContainer[float]
    routed_experts: RoutedExperts
    policy_fingerprints: _containers.ScalarMap[int, str]
    teacher_logprobs: _containers.RepeatedScalarFieldContainer[float]
    teacher: str
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., behavior_logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., rewards: _Optional[_Mapping[str, float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., turn_rewards: _Optional[_Iterable[float]] = ..., token_advantages: _Optional[_Iterable[float]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., policy_fingerprints: _Optional[_Mapping[int, str]] = ..., teacher_logprobs: _Optional[_Iterable[float]] = ..., teacher: _Optional[str] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("data", "positions", "layers", "top_k", "num_experts")
    DATA_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    positions: int
    layers: int
    top_k: int
    num_experts: int
    def __init__(self, data: _Optional[bytes] = ..., positions: _Optional[int] = ..., layers: _Optional[int] = ..., top_k: _Optional[int] = ..., num_experts: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "bucket", "offset", "nbytes", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    bucket: int
    offset: int
    nbytes: int
    checksum: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., bucket: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("index", "nbytes", "checksum", "mac")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    index: int
    nbytes: int
    checksum: int
    mac: bytes
    def __init__(self, index: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class CollectiveTransport(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "group_name", "world_size", "source_rank", "replica_ranks", "timeout_seconds", "replica_rank_counts")
    class ReplicaRanksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ReplicaRankCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RANK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    backend: CollectiveBackend
    master_address: str
    master_port: int
    group_name: str
    world_size: int
    source_rank: int
    replica_ranks: _containers.ScalarMap[str, int]
    timeout_seconds: int
    replica_rank_counts: _containers.ScalarMap[str, int]
    def __init__(self, backend: _Optional[_Union[CollectiveBackend, str]] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., group_name: _Optional[str] = ..., world_size: _Optional[int] = ..., source_rank: _Optional[int] = ..., replica_ranks: _Optional[_Mapping[str, int]] = ..., timeout_seconds: _Optional[int] = ..., replica_rank_counts: _Optional[_Mapping[str, int]] = ...) -> None: ...

class InlineTransport(_message.Message):
    __slots__ = ("chunk_bytes",)
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    chunk_bytes: int
    def __init__(self, chunk_bytes: _Optional[int] = ...) -> None: ...

class FileTransport(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SharedMemoryTransport(_message.Message):
    __slots__ = ("colocation_id", "pid", "fd")
    COLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    colocation_id: str
    pid: int
    fd: int
    def __init__(self, colocation_id: _Optional[str] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ...) -> None: ...

class Transport(_message.Message):
    __slots__ = ("collective", "inline", "file", "shared_memory")
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    collective: CollectiveTransport
    inline: InlineTransport
    file: FileTransport
    shared_memory: SharedMemoryTransport
    def __init__(self, collective: _Optional[_Union[CollectiveTransport, _Mapping]] = ..., inline: _Optional[_Union[InlineTransport, _Mapping]] = ..., file: _Optional[_Union[FileTransport, _Mapping]] = ..., shared_memory: _Optional[_Union[SharedMemoryTransport, _Mapping]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("job_id", "policy_id", "version", "mode", "base_model_fingerprint", "lora", "tensors", "buckets", "total_bytes", "transport", "checksum_algorithm", "created_at", "mac_algorithm")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MAC_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy_id: str
    version: int
    mode: SyncMode
    base_model_fingerprint: str
    lora: LoraSpec
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    total_bytes: int
    transport: Transport
    checksum_algorithm: str
    created_at: _timestamp_pb2.Timestamp
    mac_algorithm: str
    def __init__(self, job_id: _Optional[str] = ..., policy_id: _Optional[str] = ..., version: _Optional[int] = ..., mode: _Optional[_Union[SyncMode, str]] = ..., base_model_fingerprint: _Optional[str] = ..., lora: _Optional[_Union[LoraSpec, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., transport: _Optional[_Union[Transport, _Mapping]] = ..., checksum_algorithm: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., mac_algorithm: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("bucket", "offset", "data")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    offset: int
    data: bytes
    def __init__(self, bucket: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ItemStatus(_message.Message):
    __slots__ = ("index", "code", "message", "field")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: int
    message: str
    field: str
    def __init__(self, index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...
