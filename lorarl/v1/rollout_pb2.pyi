from lorarl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicySelector(_message.Message):
    __slots__ = ("job_id", "version", "engine")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    engine: str
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids", "text", "apply_chat_template", "teacher_weights")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TEACHER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    apply_chat_template: bool
    teacher_weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ..., teacher_weights: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "policy", "request_id", "teachers")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEACHERS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: _common_pb2.SamplingParams
    policy: PolicySelector
    request_id: str
    teachers: _containers.RepeatedCompositeFieldContainer[PolicySelector]
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., policy: _Optional[_Union[PolicySelector, _Mapping]] = ..., request_id: _Optional[str] = ..., teachers: _Optional[_Iterable[_Union[PolicySelector, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "token_versions", "finish_reason", "text", "top_logprobs", "routed_experts", "policy_fingerprints", "teacher_logprobs")
    class PolicyFingerprintsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    text: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    routed_experts: _common_pb2.RoutedExperts
    policy_fingerprints: _containers.ScalarMap[int, str]
    teacher_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., text: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., routed_experts: _Optional[_Union[_common_pb2.RoutedExperts, _Mapping]] = ..., policy_fingerprints: _Optional[_Mapping[int, str]] = ..., teacher_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptCompletions(_message.Message):
    __slots__ = ("prompt_token_ids", "completions", "prompt_logprobs", "prompt_top_logprobs")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("results", "teacher_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PromptCompletions]
    teacher_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[PromptCompletions, _Mapping]]] = ..., teacher_seconds: _Optional[float] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("prompt", "sampling", "policy", "request_id")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    sampling: _common_pb2.SamplingParams
    policy: PolicySelector
    request_id: str
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., policy: _Optional[_Union[PolicySelector, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "token_versions", "finish_reason", "top_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("engine", "supports_lora", "max_lora_rank", "max_loras", "modes", "base_model_fingerprint", "vocab_size", "max_model_len", "reason", "adapter_window", "dtype", "shared")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_LORA_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    engine: str
    supports_lora: bool
    max_lora_rank: int
    max_loras: int
    modes: _containers.RepeatedScalarFieldContainer[_common_pb2.SyncMode]
    base_model_fingerprint: str
    vocab_size: int
    max_model_len: int
    reason: str
    adapter_window: int
    dtype: str
    shared: bool
    def __init__(self, engine: _Optional[str] = ..., supports_lora: _Optional[bool] = ..., max_lora_rank: _Optional[int] = ..., max_loras: _Optional[int] = ..., modes: _Optional[_Iterable[_Union[_common_pb2.SyncMode, str]]] = ..., base_model_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., reason: _Optional[str] = ..., adapter_window: _Optional[int] = ..., dtype: _Optional[str] = ..., shared: _Optional[bool] = ...) -> None: ...

class GetReplicaStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadedPolicy(_message.Message):
    __slots__ = ("job_id", "version", "mode", "requests_in_flight", "active")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    mode: _common_pb2.SyncMode
    requests_in_flight: int
    active: bool
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.SyncMode, str]] = ..., requests_in_flight: _Optional[int] = ..., active: _Optional[bool] = ...) -> None: ...

class GetReplicaStatusResponse(_message.Message):
    __slots__ = ("replica_id", "policies", "paused", "requests_in_flight", "requests_queued", "peak_running_requests")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    PEAK_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    policies: _containers.RepeatedCompositeFieldContainer[LoadedPolicy]
    paused: bool
    requests_in_flight: int
    requests_queued: int
    peak_running_requests: int
    def __init__(self, replica_id: _Optional[str] = ..., policies: _Optional[_Iterable[_Union[LoadedPolicy, _Mapping]]] = ..., paused: _Optional[bool] = ..., requests_in_flight: _Optional[int] = ..., requests_queued: _Optional[int] = ..., peak_running_requests: _Optional[int] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.WeightManifest
    chunk: _common_pb2.WeightChunk
    def __init__(self, manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.WeightChunk, _Mapping]] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...
