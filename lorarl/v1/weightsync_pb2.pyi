from lorarl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ActivationOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_OUTCOME_UNSPECIFIED: _ClassVar[ActivationOutcome]
    ACTIVATION_OUTCOME_PENDING: _ClassVar[ActivationOutcome]
    ACTIVATION_OUTCOME_ACTIVE: _ClassVar[ActivationOutcome]
    ACTIVATION_OUTCOME_FAILED: _ClassVar[ActivationOutcome]
ACTIVATION_OUTCOME_UNSPECIFIED: ActivationOutcome
ACTIVATION_OUTCOME_PENDING: ActivationOutcome
ACTIVATION_OUTCOME_ACTIVE: ActivationOutcome
ACTIVATION_OUTCOME_FAILED: ActivationOutcome

class ModelCatalog(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ...) -> None: ...

class RegisterJobRequest(_message.Message):
    __slots__ = ("job_id", "base_model_fingerprint", "lora", "mode", "catalog", "start_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CATALOG_FIELD_NUMBER: _ClassVar[int]
    START_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    base_model_fingerprint: str
    lora: _common_pb2.LoraSpec
    mode: _common_pb2.SyncMode
    catalog: ModelCatalog
    start_version: int
    def __init__(self, job_id: _Optional[str] = ..., base_model_fingerprint: _Optional[str] = ..., lora: _Optional[_Union[_common_pb2.LoraSpec, _Mapping]] = ..., mode: _Optional[_Union[_common_pb2.SyncMode, str]] = ..., catalog: _Optional[_Union[ModelCatalog, _Mapping]] = ..., start_version: _Optional[int] = ...) -> None: ...

class RegisterJobResponse(_message.Message):
    __slots__ = ("mode", "reason", "latest_version")
    MODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2.SyncMode
    reason: str
    latest_version: int
    def __init__(self, mode: _Optional[_Union[_common_pb2.SyncMode, str]] = ..., reason: _Optional[str] = ..., latest_version: _Optional[int] = ...) -> None: ...

class PublishManifestRequest(_message.Message):
    __slots__ = ("manifest", "adapter", "sender_host", "sender_port", "shared_memory")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SENDER_HOST_FIELD_NUMBER: _ClassVar[int]
    SENDER_PORT_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    adapter: _common_pb2.WeightManifest
    sender_host: str
    sender_port: int
    shared_memory: _common_pb2.SharedMemoryTransport
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., adapter: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., sender_host: _Optional[str] = ..., sender_port: _Optional[int] = ..., shared_memory: _Optional[_Union[_common_pb2.SharedMemoryTransport, _Mapping]] = ...) -> None: ...

class PublishManifestResponse(_message.Message):
    __slots__ = ("manifest", "sender_rank", "duplicate")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SENDER_RANK_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    sender_rank: int
    duplicate: bool
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., sender_rank: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class UploadWeightsRequest(_message.Message):
    __slots__ = ("job_id", "chunk", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    chunk: _common_pb2.WeightChunk
    version: int
    def __init__(self, job_id: _Optional[str] = ..., chunk: _Optional[_Union[_common_pb2.WeightChunk, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class UploadWeightsResponse(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class ReplicaCapabilities(_message.Message):
    __slots__ = ("supports_lora", "max_lora_rank", "max_loras", "base_model_fingerprint", "engine", "collective_backends", "receiving_ranks", "shared", "colocation_id")
    SUPPORTS_LORA_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVING_RANKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    COLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    supports_lora: bool
    max_lora_rank: int
    max_loras: int
    base_model_fingerprint: str
    engine: str
    collective_backends: _containers.RepeatedScalarFieldContainer[_common_pb2.CollectiveBackend]
    receiving_ranks: int
    shared: bool
    colocation_id: str
    def __init__(self, supports_lora: _Optional[bool] = ..., max_lora_rank: _Optional[int] = ..., max_loras: _Optional[int] = ..., base_model_fingerprint: _Optional[str] = ..., engine: _Optional[str] = ..., collective_backends: _Optional[_Iterable[_Union[_common_pb2.CollectiveBackend, str]]] = ..., receiving_ranks: _Optional[int] = ..., shared: _Optional[bool] = ..., colocation_id: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("replica_id", "job_ids", "capabilities", "host", "active_versions", "serve_address")
    class ActiveVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SERVE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    capabilities: ReplicaCapabilities
    host: str
    active_versions: _containers.ScalarMap[str, int]
    serve_address: str
    def __init__(self, replica_id: _Optional[str] = ..., job_ids: _Optional[_Iterable[str]] = ..., capabilities: _Optional[_Union[ReplicaCapabilities, _Mapping]] = ..., host: _Optional[str] = ..., active_versions: _Optional[_Mapping[str, int]] = ..., serve_address: _Optional[str] = ...) -> None: ...

class StageEvent(_message.Message):
    __slots__ = ("manifest", "rank", "serve_mode", "rank_count")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SERVE_MODE_FIELD_NUMBER: _ClassVar[int]
    RANK_COUNT_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    rank: int
    serve_mode: _common_pb2.SyncMode
    rank_count: int
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., rank: _Optional[int] = ..., serve_mode: _Optional[_Union[_common_pb2.SyncMode, str]] = ..., rank_count: _Optional[int] = ...) -> None: ...

class CommitEvent(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class AbortEvent(_message.Message):
    __slots__ = ("job_id", "version", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("stage", "commit", "abort")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    stage: StageEvent
    commit: CommitEvent
    abort: AbortEvent
    def __init__(self, stage: _Optional[_Union[StageEvent, _Mapping]] = ..., commit: _Optional[_Union[CommitEvent, _Mapping]] = ..., abort: _Optional[_Union[AbortEvent, _Mapping]] = ...) -> None: ...

class ReportStagedRequest(_message.Message):
    __slots__ = ("replica_id", "job_id", "version", "ok", "error")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    job_id: str
    version: int
    ok: bool
    error: str
    def __init__(self, replica_id: _Optional[str] = ..., job_id: _Optional[str] = ..., version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ReportStagedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportActiveRequest(_message.Message):
    __slots__ = ("replica_id", "job_id", "version")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    job_id: str
    version: int
    def __init__(self, replica_id: _Optional[str] = ..., job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ReportActiveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("job_id", "version", "chunk_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    chunk_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class FetchWeightsResponse(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    chunk: _common_pb2.WeightChunk
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.WeightChunk, _Mapping]] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ...) -> None: ...

class GetSyncStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ReplicaState(_message.Message):
    __slots__ = ("replica_id", "active_version", "staged_version", "connected", "last_error", "serve_address", "capabilities")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    active_version: int
    staged_version: int
    connected: bool
    last_error: str
    serve_address: str
    capabilities: ReplicaCapabilities
    def __init__(self, replica_id: _Optional[str] = ..., active_version: _Optional[int] = ..., staged_version: _Optional[int] = ..., connected: _Optional[bool] = ..., last_error: _Optional[str] = ..., serve_address: _Optional[str] = ..., capabilities: _Optional[_Union[ReplicaCapabilities, _Mapping]] = ...) -> None: ...

class JobSyncStatus(_message.Message):
    __slots__ = ("job_id", "latest_version", "mode", "replicas", "active_version", "mode_reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    latest_version: int
    mode: _common_pb2.SyncMode
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaState]
    active_version: int
    mode_reason: str
    def __init__(self, job_id: _Optional[str] = ..., latest_version: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.SyncMode, str]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaState, _Mapping]]] = ..., active_version: _Optional[int] = ..., mode_reason: _Optional[str] = ...) -> None: ...

class GetSyncStatusResponse(_message.Message):
    __slots__ = ("jobs", "fleet")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobSyncStatus]
    fleet: _containers.RepeatedCompositeFieldContainer[ReplicaState]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobSyncStatus, _Mapping]]] = ..., fleet: _Optional[_Iterable[_Union[ReplicaState, _Mapping]]] = ...) -> None: ...

class AwaitActivationRequest(_message.Message):
    __slots__ = ("job_id", "version", "timeout_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    timeout_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ReplicaActivation(_message.Message):
    __slots__ = ("replica_id", "staged", "active", "error", "transport")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    staged: bool
    active: bool
    error: str
    transport: str
    def __init__(self, replica_id: _Optional[str] = ..., staged: _Optional[bool] = ..., active: _Optional[bool] = ..., error: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class AwaitActivationResponse(_message.Message):
    __slots__ = ("job_id", "version", "outcome", "error", "failed_replicas", "replicas")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    outcome: ActivationOutcome
    error: str
    failed_replicas: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaActivation]
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., outcome: _Optional[_Union[ActivationOutcome, str]] = ..., error: _Optional[str] = ..., failed_replicas: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaActivation, _Mapping]]] = ...) -> None: ...
