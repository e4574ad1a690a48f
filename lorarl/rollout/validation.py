"""Generate requests from protobuf to validated plain data; every problem names its request field.

Runs before a request reaches the core, so a malformed request is answered INVALID_ARGUMENT at
once and never disturbs requests in flight.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from lorarl.common.errors import InvalidArgumentError
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.prompts import PromptRenderer
from lorarl.rollout.schema import EngineInfo, GenerateInput, PolicyRef, Sampling
from lorarl.v1 import common_pb2, rollout_pb2

MAX_TEMPERATURE = 2.0  # vLLM refuses more (and OpenAI allows 0..2)
MAX_STOP_STRINGS = 32
MAX_SEED = 2**63 - 1
#: Teachers one request may name (each a policy this replica serves; every one costs a prefill per scored row).
MAX_TEACHERS = 16


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this replica."""

    vocab_size: int
    max_model_len: int
    max_n: int
    max_logprobs: int
    default_max_tokens: int
    teacher_engines: frozenset[str] = frozenset()  # rollout.teacher_engines' names

    @classmethod
    def of(cls, info: EngineInfo, settings: RolloutSettings) -> Limits:
        return cls(info.vocab_size, info.max_model_len, settings.max_n, settings.max_logprobs,
                   settings.default_max_tokens, frozenset(settings.teacher_engines))


def generate_input(request: rollout_pb2.GenerateRequest, limits: Limits, renderer: PromptRenderer | None
                   ) -> GenerateInput:
    if not request.prompts:
        raise InvalidArgumentError("prompts", "at least one prompt is required")
    prompts = tuple(prompt_ids(p, limits, renderer, f"prompts[{i}]") for i, p in enumerate(request.prompts))
    teachers = tuple(teacher_ref(t, limits, f"teachers[{i}]") for i, t in enumerate(request.teachers))
    weights = teacher_weights(request, len(teachers))
    # a teacher re-reads prompt + completion as its prompt and samples one token: one position more
    params = sampling(request.sampling, max(map(len, prompts)), limits, reserve=1 if teachers else 0)
    if teachers and params.prompt_logprobs:
        raise InvalidArgumentError("sampling.prompt_logprobs", "is not served together with teachers")
    return GenerateInput(request_id=request.request_id or uuid.uuid4().hex, prompts=prompts, sampling=params,
                         policy=policy_ref(request.policy), teachers=teachers, teacher_weights=weights)


def teacher_weights(request: rollout_pb2.GenerateRequest, teachers: int) -> tuple[tuple[float, ...], ...]:
    """Each prompt's teacher weights: none, or one per teacher, finite, >= 0, not all 0."""
    if teachers > MAX_TEACHERS:
        raise InvalidArgumentError("teachers", f"{teachers} teachers; at most {MAX_TEACHERS}")
    out = []
    for i, prompt in enumerate(request.prompts):
        weights = tuple(prompt.teacher_weights)
        field = f"prompts[{i}].teacher_weights"
        if weights and not teachers:
            raise InvalidArgumentError(field, "are given but the request names no teachers")
        if weights and len(weights) != teachers:
            raise InvalidArgumentError(field, f"has {len(weights)} entries for {teachers} teachers (one each, or "
                                              "none: not scored)")
        if any(not math.isfinite(w) or w < 0 for w in weights):
            raise InvalidArgumentError(field, f"must be finite and >= 0, got {list(weights)}")
        if weights and not sum(weights) > 0:
            raise InvalidArgumentError(field, "are all 0: name at least one teacher (or send none: not scored)")
        out.append(weights)
    return tuple(out)


def stream_input(request: rollout_pb2.GenerateStreamRequest, limits: Limits, renderer: PromptRenderer | None
                 ) -> GenerateInput:
    prompt = prompt_ids(request.prompt, limits, renderer, "prompt")
    if request.sampling.prompt_logprobs:
        raise InvalidArgumentError("sampling.prompt_logprobs", "is served by Generate, not GenerateStream")
    return GenerateInput(request_id=request.request_id or uuid.uuid4().hex, prompts=(prompt,),
                         sampling=sampling(request.sampling, len(prompt), limits), policy=policy_ref(request.policy))


def policy_ref(selector: rollout_pb2.PolicySelector, field: str = "policy") -> PolicyRef:
    """The policy a request samples from: this replica's (an engine of its own is a teacher's only)."""
    if selector.engine:
        raise InvalidArgumentError(f"{field}.engine", f"names engine {selector.engine!r}: only a teacher "
                                                      "(GenerateRequest.teachers) may be served by another engine")
    return PolicyRef(job_id=selector.job_id, version=selector.version)


def teacher_ref(selector: rollout_pb2.PolicySelector, limits: Limits, field: str) -> PolicyRef:
    """A teacher: a policy this replica serves, or by ``engine`` one of its rollout.teacher_engines (that
    engine's own model: no job_id or version)."""
    if not selector.engine:
        return PolicyRef(job_id=selector.job_id, version=selector.version)
    if selector.engine not in limits.teacher_engines:
        known = ", ".join(sorted(limits.teacher_engines)) or "none"
        raise InvalidArgumentError(f"{field}.engine", f"no teacher engine {selector.engine!r} on this replica "
                                                      f"(rollout.teacher_engines: {known})")
    if selector.job_id or selector.version:
        raise InvalidArgumentError(f"{field}.job_id", f"teacher engine {selector.engine!r} serves its own model: "
                                                      "leave job_id and version empty")
    return PolicyRef(engine=selector.engine)


def prompt_ids(prompt: rollout_pb2.Prompt, limits: Limits, renderer: PromptRenderer | None, field: str
               ) -> tuple[int, ...]:
    if prompt.token_ids:
        ids = list(prompt.token_ids)
        for j, tok in enumerate(ids):
            if tok >= limits.vocab_size:
                raise InvalidArgumentError(f"{field}.token_ids[{j}]",
                                           f"token id {tok} is outside the vocabulary (size {limits.vocab_size})")
    elif prompt.text:
        if renderer is None:
            raise InvalidArgumentError(f"{field}.text", "this replica has no tokenizer: send token_ids")
        ids = renderer.encode(prompt.text, chat=prompt.apply_chat_template, field=field)
    else:
        raise InvalidArgumentError(field, "empty prompt: set token_ids or text")
    if not ids:
        raise InvalidArgumentError(field, "the prompt renders to no tokens")
    if len(ids) >= limits.max_model_len:
        raise InvalidArgumentError(field, f"prompt of {len(ids)} tokens leaves no room to generate within "
                                          f"max_model_len {limits.max_model_len}")
    return tuple(ids)


def sampling(params: common_pb2.SamplingParams, longest_prompt: int, limits: Limits, reserve: int = 0) -> Sampling:
    """Sampling with zero values resolved (n 0 -> 1, top_p 0 -> 1, top_k 0 -> off, max_tokens 0 -> default);
    ``reserve``: positions kept free after prompt + completion (a teacher's scoring reads one more)."""
    n = params.n or 1
    if n > limits.max_n:
        raise InvalidArgumentError("sampling.n", f"{n} completions per prompt; at most {limits.max_n}")
    temperature = params.temperature
    if not math.isfinite(temperature) or temperature < 0 or temperature > MAX_TEMPERATURE:
        raise InvalidArgumentError("sampling.temperature", f"must be in 0..{MAX_TEMPERATURE} (0: greedy), "
                                                          f"got {temperature}")
    top_p = params.top_p or 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgumentError("sampling.top_p", f"must be in (0, 1] (0: disabled), got {params.top_p}")
    top_k = params.top_k
    if top_k < -1 or top_k > limits.vocab_size:
        raise InvalidArgumentError("sampling.top_k", f"must be -1 or 0 (disabled) or 1..{limits.vocab_size}, "
                                                    f"got {top_k}")
    room = limits.max_model_len - longest_prompt - reserve
    max_tokens = params.max_tokens or min(limits.default_max_tokens, room)
    if max_tokens > room or max_tokens < 1:
        kept = f" less the {reserve} position teachers read" if reserve else ""
        raise InvalidArgumentError("sampling.max_tokens", f"prompt ({longest_prompt} tokens) + max_tokens "
                                                         f"({max_tokens}) exceeds max_model_len {limits.max_model_len}"
                                                         f"{kept}")
    stop = tuple(params.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise InvalidArgumentError("sampling.stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
    for j, tok in enumerate(params.stop_token_ids):
        if tok >= limits.vocab_size:
            raise InvalidArgumentError(f"sampling.stop_token_ids[{j}]",
                                       f"token id {tok} is outside the vocabulary (size {limits.vocab_size})")
    seed = params.seed if params.HasField("seed") else None
    if seed is not None and seed > MAX_SEED:
        raise InvalidArgumentError("sampling.seed", f"must be < 2**63, got {seed}")
    if params.logprobs > limits.max_logprobs:
        raise InvalidArgumentError("sampling.logprobs", f"at most {limits.max_logprobs} top logprobs, "
                                                        f"got {params.logprobs}")
    return Sampling(n=n, temperature=float(temperature), top_p=float(top_p), top_k=-1 if top_k in (0, -1) else top_k,
                    max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(params.stop_token_ids), seed=seed,
                    logprobs=params.logprobs, ignore_eos=params.ignore_eos, prompt_logprobs=params.prompt_logprobs)
