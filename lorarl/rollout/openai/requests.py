"""The top-level fields of the two completion requests, as pydantic schemas: types checked strictly (no
"3" for 3), ranges where OpenAI has them, and nothing a caller sends left unread.

``echo`` returns the prompt with its tokens' logprobs (vLLM's prompt logprobs), and ``max_tokens: 0`` with
it only those: what lm-evaluation-harness's log-likelihood (multiple-choice) tasks send.
A field the endpoint does not serve is refused with 400 naming it, unless its value changes nothing
(``presence_penalty: 0``, an empty ``logit_bias``, ``best_of`` equal to ``n``): clients that send OpenAI's
defaults explicitly keep working, and none gets output computed differently from what it asked for. A
field OpenAI does not know is refused as OpenAI refuses it ("Unrecognized request argument supplied").
Messages and tools are checked field by field in app.py, where the errors can name ``messages[i]``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lorarl.contract.agent_sessions import TEACHERS_HEADER

#: The most top logprobs OpenAI returns per token.
MAX_TOP_LOGPROBS = 20


def _neutral(name: str, value: Any, neutral: Any, why: str) -> Any:
    if value is not None and value != neutral:
        raise ValueError(f"{name} is not served by this endpoint ({why}); send {neutral!r} or leave it out")
    return value


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension: -1 or 0 means off
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # kept by OpenAI for its dashboards; changes no output here
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None, info: Any) -> float | None:
        return _neutral(info.field_name, value, 0.0, "vLLM's penalties would change the sampled policy's "
                                                     "logprobs the trainer learns from")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return _neutral("logit_bias", value or None, None, "a bias would change the sampled policy's logprobs")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt's logprobs, nothing generated
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _neutral("suffix", value, None, "insertion is not served")

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionBody:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not served (only best_of == n: every sample is returned)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is served with echo (the prompt's logprobs) only")
        if self.echo and self.stream:
            raise ValueError("echo with stream is not served: send echo without stream")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is an empty list")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatBody(_Common):
    messages: list[Any]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _neutral("response_format", value if value != {"type": "text"} else None, None,
                        "structured output is not served")

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or []):
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError(f"tools[{i}].function.name must be a non-empty string")
            if "parameters" in function and not isinstance(function["parameters"], dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        return value

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(schema: type[BaseModel], body: dict[str, Any]) -> Any:
    """The body as ``schema``; ValueError(param, message) as the first problem a person can act on."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise RequestError(param, f"Unrecognized request argument supplied: {param}") from None
        message = error["msg"].removeprefix("Value error, ")
        raise RequestError(param, f"{param}: {message}" if param else message) from None


class RequestError(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class TeacherEntry(BaseModel):
    """One teacher of a scored session (the ``X-Lorarl-Teachers`` header, a JSON list of these): a policy this
    replica serves (``job_id``, ``version`` 0 its latest) or a full-model teacher's engine (``engine``), and its
    weight in the mixture of teachers that scores the turn (a route: 1 for the prompt's teacher, 0 the others)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    job_id: str = ""
    version: int = Field(0, ge=0)
    engine: str = ""
    weight: float = Field(ge=0.0, allow_inf_nan=False)


def teacher_entries(raw: str) -> list[TeacherEntry]:
    """The ``X-Lorarl-Teachers`` header's value; RequestError naming the entry and field at fault."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestError(TEACHERS_HEADER, f"{TEACHERS_HEADER} is not JSON: {e}") from None
    if not isinstance(value, list) or not value:
        raise RequestError(TEACHERS_HEADER, f"{TEACHERS_HEADER} must be a non-empty JSON list of "
                                            "{job_id, version, engine, weight} objects")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise RequestError(f"{TEACHERS_HEADER}[{i}]", f"{TEACHERS_HEADER}[{i}] must be a JSON object")
        try:
            out.append(parse(TeacherEntry, entry))
        except RequestError as e:
            raise RequestError(f"{TEACHERS_HEADER}[{i}].{e.param}", f"{TEACHERS_HEADER}[{i}]: {e}") from None
    return out
