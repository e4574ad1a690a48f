"""Plain data the rollout core, its engines and the servicer exchange (no protobuf, no torch).

Keeping these free of gRPC and of any engine lets the core run on vLLM, on transformers, or on a
fake engine in unit tests, and keeps protobuf conversion in one place (lorarl/rollout/convert.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from lorarl.contract import versions
from lorarl.contract.routes import RoutedExperts

BASE_JOB = ""
"""job_id of the base model (no adapter, no merged weights)."""
LATEST = versions.LATEST
"""PolicyRef.version meaning "the latest active version of the job"."""


class Finish(enum.Enum):
    """Why a completion (or one engine segment of it) ended."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Mode(enum.Enum):
    """How a policy version is served: adapter at run time (mode 1) or merged weights (mode 2)."""

    ADAPTER = "adapter"
    MERGED = "merged"


@dataclass(frozen=True)
class Sampling:
    """Validated sampling parameters of one request (n already resolved, max_tokens > 0)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int = 0
    ignore_eos: bool = False
    prompt_logprobs: bool = False  # the prompt tokens' logprobs, once per prompt (its first completion's)

    def for_segment(self, max_tokens: int, seed: int | None, prompt_logprobs: bool = False) -> Sampling:
        """One completion's parameters for one engine segment (n = 1); ``prompt_logprobs``: this segment
        reports the prompt's (the first segment of a prompt's first completion)."""
        return replace(self, n=1, max_tokens=max_tokens, seed=seed, prompt_logprobs=prompt_logprobs)


@dataclass(frozen=True)
class PolicyRef:
    """What a request asks for: a job ("" = base model) and a version (0 = latest)."""

    job_id: str = BASE_JOB
    version: int = LATEST
    #: a teacher on an engine of its own (its name in rollout.teacher_engines): that engine's model; "": this one
    engine: str = ""

    @property
    def is_base(self) -> bool:
        return self.job_id == BASE_JOB

    def __str__(self) -> str:
        if self.engine:
            return f"teacher engine {self.engine!r}"
        if self.is_base:
            return "base model"
        return f"{self.job_id} {'latest' if self.version == LATEST else f'v{self.version}'}"


@dataclass(frozen=True)
class AdapterHandle:
    """How the engine knows one adapter version: a versioned name and a unique integer id."""

    name: str
    lora_int_id: int
    rank: int
    path: str = ""

    @property
    def key(self) -> str:
        """Unique per load, never reused in this process: vLLM hashes an adapter's name and path into its
        prefix-cache keys, so a version loaded again with other weights can never hit stale KV blocks."""
        return f"{self.name}.{self.lora_int_id}"


@dataclass(frozen=True)
class ServedPolicy:
    """A concrete policy a segment runs under; `version` is what its tokens are tagged with."""

    job_id: str
    version: int
    mode: Mode | None = None  # None: the base model
    adapter: AdapterHandle | None = None
    weights: str = ""  # the version's fingerprint, which its completions carry ("" for the base model)

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.version)


@dataclass(frozen=True)
class GenerateInput:
    """One validated Generate request: token-id prompts, sampling, policy and request id."""

    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    sampling: Sampling
    policy: PolicyRef = PolicyRef()
    #: on-policy distillation: the policies that score every completion (lorarl.rollout.teachers), and per prompt
    #: each one's weight (() for a prompt that is not scored)
    teachers: tuple[PolicyRef, ...] = ()
    teacher_weights: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True)
class SegmentSpec:
    """One engine request: a prompt (maybe continued) decoded under one fixed policy."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    adapter: AdapterHandle | None = None
    stream: bool = True  # False: the engine may deliver all tokens in the last event (cheaper)


@dataclass
class SegmentEvent:
    """New tokens from the engine for one segment; `finish` is set on its last event."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish: Finish | None = None
    prompt_logprobs: list[float] | None = None  # when asked: one per prompt token, the first NaN
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # with logprobs > 0: per prompt token
    routes: RoutedExperts | None = None  # on the last event, when the engine records routes (MoE)


@dataclass
class CompletionChunk:
    """New tokens of one completion as they are produced (streaming)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish: Finish | None = None


@dataclass
class Completion:
    """A finished completion: tokens, their logprobs and the policy version behind each token."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish: Finish = Finish.ABORT
    text: str = ""
    segments: int = 0
    #: experts chosen at each position of prompt + completion but the last (recording engines, MoE)
    routes: RoutedExperts | None = None
    #: the fingerprint of each version that produced tokens of it (the served-policy guard reads them)
    fingerprints: dict[int, str] = field(default_factory=dict)
    #: per token, the log of the teachers' weighted probability of it (when the request names teachers)
    teacher_logprobs: list[float] | None = None

    def add_routes(self, routes: RoutedExperts) -> None:
        """A segment's routes: over the whole sequence so far, so what it computed is laid over the earlier ones."""
        self.routes = routes if self.routes is None else self.routes.overlay(routes)

    def extend(self, chunk: CompletionChunk) -> None:
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.versions += chunk.versions
        self.top_logprobs += chunk.top_logprobs
        if chunk.finish is not None:
            self.finish = chunk.finish


@dataclass
class PromptResult:
    prompt_token_ids: list[int]
    completions: list[Completion]
    prompt_logprobs: list[float] | None = None  # when asked (Sampling.prompt_logprobs)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # ...with Sampling.logprobs > 0


@dataclass(frozen=True)
class EngineInfo:
    """What an engine can do, for validation and GetCapabilities."""

    engine: str
    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    is_moe: bool
    supports_lora: bool
    lora_reason: str
    max_lora_rank: int
    max_loras: int
    dtype: str = ""  # the served weights' dtype name (float32, bfloat16, float16)


@dataclass
class EngineStats:
    """Load of the engine now, and the largest batch seen (evidence of continuous batching)."""

    running: int = 0
    waiting: int = 0
    peak_running: int = 0
