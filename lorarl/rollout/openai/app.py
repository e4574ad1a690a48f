"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and the session record, over the rollout core.

A thin layer: each request becomes the same token-id ``GenerateRequest`` the gRPC service takes, checked by
the same validation (lorarl.rollout.validation) and served by the same core, so an agent's tokens carry
their policy versions like every other completion. What differs from OpenAI, on purpose:

- ``model`` names a policy: the base model (its directory name, or ``base``), a job (its latest version)
  or ``job:vN`` (that version, while the replica holds it);
- the session (an episode) is the ``X-Session-Id`` header, else the ``user`` field; its turns, with their
  exact token ids, logprobs and versions, are at ``GET /v1/sessions/{id}`` (``DELETE`` forgets them);
- each choice carries ``lorarl: {token_ids, versions}`` beside the OpenAI fields;
- a session's chat turns are scored by teachers when the request carries ``X-Lorarl-Teachers`` (a JSON list of
  ``{job_id, version, engine, weight}``: on-policy distillation of an agent, set by the loop's
  ``ctx.openai_client``): once a turn is sampled, each teacher re-reads it in this engine (one prefill, as
  Generate's teachers do) and the turn's record carries ``teacher_logprobs``, its tokens' log of the teachers'
  weighted probability, for the trainer.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad field (named
in ``param``), 401 without the bearer token, 404 for a policy or session this replica does not have.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lorarl.common.auth import tokens_match
from lorarl.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from lorarl.contract.agent_sessions import SESSION_HEADER, TEACHERS_HEADER
from lorarl.contract.chat import ChatRenderer
from lorarl.contract.tool_calls import OPEN, parse_tool_calls
from lorarl.rollout import validation
from lorarl.rollout.core import RolloutCore
from lorarl.rollout.openai.requests import (
    ChatBody,
    CompletionBody,
    RequestError,
    parse,
    teacher_entries,
)
from lorarl.rollout.openai.sessions import SessionStore, Turn, normalized
from lorarl.rollout.schema import Completion, Finish, PromptResult
from lorarl.v1 import common_pb2, rollout_pb2

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
STATUS = {InvalidArgumentError: 400, NotFoundError: 404, FailedPreconditionError: 409,
          ResourceExhaustedError: 429, UnavailableError: 503}


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


@dataclass
class Endpoint:
    """What the routes share: the core, the chat renderer, the sessions, the token and the base model's name."""

    core: RolloutCore
    renderer: ChatRenderer
    sessions: SessionStore
    token: str | None
    base_name: str

    def limits(self) -> validation.Limits:
        return validation.Limits.of(self.core.info, self.core.settings)

    def policy(self, model: Any) -> rollout_pb2.PolicySelector:
        """``model`` -> which policy serves: base, a job's latest, or ``job:vN``."""
        if not isinstance(model, str) or not model:
            raise HttpError(400, "model is required: the base model's name, a job id, or job:vN", "model")
        if model in (self.base_name, "base") or model.rstrip("/") == self.core.info.model_path.rstrip("/"):
            return rollout_pb2.PolicySelector()  # the base: by name, "base", or the model's own path
        job, sep, version = model.rpartition(":v")
        if sep and job and version.isdigit():
            return rollout_pb2.PolicySelector(job_id=job, version=int(version))
        return rollout_pb2.PolicySelector(job_id=model)


# ---------------------------------------------------------------------------------------------- parsing


def sampling_params(request: ChatBody | CompletionBody) -> tuple[common_pb2.SamplingParams, bool]:
    """The request's sampling fields as the rollout's SamplingParams (their upper bounds checked by
    validation), and whether the reply carries logprobs (every sampled token's logprob is kept anyway)."""
    if isinstance(request, ChatBody):
        wanted = request.logprobs
        logprobs = (request.top_logprobs or 0) if wanted else 0
        max_tokens = request.completion_limit()
    else:
        logprobs = request.logprobs or 0
        wanted = request.logprobs is not None
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens  # echo's 0: one token, not returned
    params = common_pb2.SamplingParams(
        n=request.n, temperature=float(request.temperature), top_p=float(request.top_p),
        top_k=request.top_k or 0, max_tokens=max_tokens or 0, stop=request.stops(), logprobs=logprobs,
        prompt_logprobs=isinstance(request, CompletionBody) and request.echo and wanted)
    if request.seed is not None:
        params.seed = request.seed
    return params, wanted


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text up to (not including) the first stop string in it, as OpenAI returns it; the token ids keep
    what the engine generated (the trainer learns from those)."""
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
            raise HttpError(400, f"messages[{i}] needs a role of system, user, assistant or tool", f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise HttpError(400, f"messages[{i}].content: only text parts are served", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise HttpError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        if content is None and not message.get("tool_calls"):
            raise HttpError(400, f"messages[{i}] has neither content nor tool_calls", f"messages[{i}].content")
        clean: dict[str, Any] = {"role": message["role"], "content": content}
        if message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise HttpError(400, f"messages[{i}].tool_calls must be a list of function calls",
                                f"messages[{i}].tool_calls")
            clean["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": c["function"].get("arguments", "{}")}} for c in calls]
        if message.get("tool_call_id"):
            clean["tool_call_id"] = str(message["tool_call_id"])
        out.append(clean)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise HttpError(400, "tool_choice: only 'auto' and 'none' are served", "tool_choice")
    return out, (tools or None) if choice != "none" else None


# --------------------------------------------------------------------------------------------- replies


def finish_reason(finish: Finish, calls: list) -> str:
    """OpenAI's finish reasons, plus ``abort`` for a completion the replica cut short (its policy went away)."""
    if finish is Finish.ABORT:
        return "abort"
    if calls:
        return "tool_calls"
    return "length" if finish is Finish.LENGTH else "stop"


def chat_logprobs(renderer: ChatRenderer, token_ids: list[int], logprobs: list[float],
                  tops: list[dict[int, float]]) -> dict[str, Any]:
    content = []
    for i, (token, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        text = renderer.tokenizer.decode([token])
        top = tops[i] if i < len(tops) else {}
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": renderer.tokenizer.decode([t]), "logprob": lp,
                                          "bytes": list(renderer.tokenizer.decode([t]).encode())}
                                         for t, lp in top.items()]})
    return {"content": content}


def text_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float | None],
                  tops: Sequence[dict[int, float] | None], offset: int = 0) -> dict[str, Any]:
    """The text completion's ``logprobs`` object (tokens, their logprobs, the top alternatives, where each
    token starts in the text), from ``offset`` characters on."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    starts, at = [], offset
    for token in tokens:
        starts.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": [None if top is None else {tokenizer.decode([t]): lp for t, lp in top.items()}
                             for top in tops],
            "text_offset": starts}


def echoed(tokenizer: Any, prompt_ids: list[int], result: Any) -> dict[str, Any]:
    """The prompt's part of an echoed ``logprobs``: OpenAI's null for the first token (nothing predicts it)."""
    rest = len(prompt_ids) - 1
    logprobs = [None, *(result.prompt_logprobs or [None] * len(prompt_ids))[1:]]
    tops = [None, *(result.prompt_top_logprobs[1:] if result.prompt_top_logprobs else [{}] * rest)]
    return text_logprobs(tokenizer, prompt_ids, logprobs, tops)


def refused(request: Request, status: int, message: str, param: str | None = None,
            kind: str = "invalid_request_error") -> JSONResponse:
    """The error reply, and a log line for it: a refused request is visible in the rollout's log."""
    logger.info("refused %s %s: %d %s", request.method, request.url.path, status, message)
    return error_response(status, message, param, kind)


def create_app(endpoint: Endpoint) -> FastAPI:
    app = FastAPI(title="lorarl rollout (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if endpoint.token is not None:
            header = request.headers.get("authorization", "")
            scheme, _, presented = header.partition(" ")
            if scheme.lower() != "bearer" or not tokens_match(presented.strip(), endpoint.token):
                return error_response(401, "missing or invalid bearer token (Authorization: Bearer <token>, the "
                                           "rollout service's token)", kind="authentication_error")
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            return error_response(413, f"request body over {MAX_BODY_BYTES} bytes")
        try:
            return await call_next(request)
        except HttpError as e:
            return refused(request, e.status, e.message, e.param, e.kind)
        except RequestError as e:
            return refused(request, 400, str(e), e.param)
        except tuple(STATUS) as e:
            field = getattr(e, "field", None) or None
            return refused(request, STATUS[type(e)], f"{field}: {e}" if field else str(e), field)
        except (ValueError, TypeError, OverflowError) as e:  # a value the wire types cannot hold (protobuf ranges)
            return refused(request, 400, f"invalid request: {e}")

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HttpError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return body

    def session_of(request: Request, body: dict[str, Any]) -> str:
        session = request.headers.get(SESSION_HEADER) or body.get("user") or ""
        if not isinstance(session, str) or len(session) > 256:
            raise HttpError(400, "the session id (X-Session-Id or user) must be a string of at most 256 characters",
                            "user")
        return session

    def teachers_of(request: Request, session_id: str) -> tuple[list[rollout_pb2.PolicySelector], list[float]]:
        """The teachers that score this turn (``X-Lorarl-Teachers``) and their weights; none without the header."""
        raw = request.headers.get(TEACHERS_HEADER)
        if raw is None:
            return [], []
        if not session_id:
            raise HttpError(400, f"{TEACHERS_HEADER} scores the turns of a session: send X-Session-Id (or user) "
                                 "too, and read the scores at GET /v1/sessions/{id}", TEACHERS_HEADER)
        entries = teacher_entries(raw)
        selectors = [rollout_pb2.PolicySelector(job_id=e.job_id, version=e.version, engine=e.engine)
                     for e in entries]
        return selectors, [e.weight for e in entries]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        ids = [endpoint.base_name, *(f"{job}" for job in sorted(endpoint.core.active_versions())),
               *(f"{job}:v{version}" for job, version in sorted(endpoint.core.active_versions().items()))]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": created, "owned_by": "lorarl"}
                                           for i in ids]}

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str) -> dict[str, Any]:
        turns = endpoint.sessions.turns(session_id)
        if turns is None:
            raise HttpError(404, f"no session {session_id!r} on this replica", kind="not_found_error")
        return {"session": session_id, "turns": [t.as_json() for t in turns]}

    @app.delete("/v1/sessions/{session_id}")
    async def forget(session_id: str) -> Response:
        if not endpoint.sessions.pop(session_id):
            raise HttpError(404, f"no session {session_id!r} on this replica", kind="not_found_error")
        return Response(status_code=204)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await body_of(request)
        parsed: ChatBody = parse(ChatBody, body)
        messages, tools = chat_messages(body)
        session_id = session_of(request, body)
        keys = [normalized(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        earlier = endpoint.sessions.continued(session_id, keys, tools_key) if session_id else None
        try:
            prompt = None
            if earlier is not None:
                turn, start = earlier
                ended = turn.token_ids[-1:] == [endpoint.renderer.end_of_turn_id]
                with contextlib.suppress(ValueError):  # a template without a usable end of turn: render it all
                    prompt = [*turn.prompt_ids, *turn.token_ids,
                              *([] if ended else [endpoint.renderer.end_of_turn_id]),
                              *endpoint.renderer.render_followup(messages[start:], tools=tools)]
            if prompt is None:
                prompt = endpoint.renderer.render(messages, tools=tools)
        except ValueError as e:  # the template could not render these messages
            raise HttpError(400, f"messages: {e}", "messages") from None
        except Exception as e:  # jinja's own errors (a missing field the template reads)
            raise HttpError(400, f"messages: the chat template cannot render them: {type(e).__name__}: {e}",
                            "messages") from None
        params, with_logprobs = sampling_params(parsed)
        stops = parsed.stops()
        model = parsed.model
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        teachers, weights = teachers_of(request, session_id)
        generate = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=prompt, teacher_weights=weights)], sampling=params,
            policy=endpoint.policy(model), request_id=request_id, teachers=teachers)
        # with teachers: their refs and weights checked, and one position kept free for the scoring prefill
        try:
            request_input = validation.generate_input(generate, endpoint.limits(), None)
        except InvalidArgumentError as e:
            if teachers and (e.field.startswith("teachers") or e.field.endswith("teacher_weights")):
                raise HttpError(400, f"{TEACHERS_HEADER}: {e.field}: {e}", TEACHERS_HEADER) from None
            raise
        served = endpoint.core.active_versions()
        for t in teachers:  # known before sampling: a stream's 200 is sent before its turn is scored
            if t.job_id and t.job_id not in served:
                raise HttpError(404, f"{TEACHERS_HEADER}: no teacher {t.job_id!r} on this replica (it serves "
                                     f"{sorted(served) or 'no job'})", TEACHERS_HEADER, kind="not_found_error")

        async def remember(completion: Completion, reply: dict, reason: str, seconds: float | None = None) -> None:
            """Records the turn in its session; ``seconds`` None: not scored yet (a streamed turn), so a scored
            session's turn is scored here, once whole."""
            if not session_id:
                return
            if seconds is None:
                seconds = await endpoint.core.score(request_input, [PromptResult(list(prompt), [completion])]) \
                    if teachers else 0.0
            endpoint.sessions.record(session_id, Turn(
                keys, tools_key, normalized(reply), list(prompt), completion.token_ids, completion.logprobs,
                completion.versions, reason, str(model), completion.teacher_logprobs, seconds))

        if parsed.stream:
            include_usage = bool((parsed.stream_options or {}).get("include_usage"))
            stream_input = validation.stream_input(_stream_request(generate), endpoint.limits(), None)  # before 200
            if teachers:
                stream_input = replace(stream_input, sampling=request_input.sampling)
            return StreamingResponse(stream_chat(endpoint, stream_input, request_id, str(model), bool(tools),
                                                 with_logprobs, include_usage, remember, stops),
                                     media_type="text/event-stream")
        (result,), teacher_seconds = await endpoint.core.generate_scored(request_input)
        choices = []
        for index, c in enumerate(result.completions):
            text, _ = cut_at_stop(endpoint.renderer.decode(c.token_ids), stops)
            content, calls = parse_tool_calls(text) if tools else (text, [])
            reason = finish_reason(c.finish, calls)
            reply = {"role": "assistant", "content": content if (content or not calls) else None,
                     **({"tool_calls": calls} if calls else {})}
            await remember(c, reply, reason, teacher_seconds if index == 0 else 0.0)  # the batch's time, once
            choices.append({"index": index, "message": reply, "finish_reason": reason,
                            "logprobs": chat_logprobs(endpoint.renderer, c.token_ids, c.logprobs, c.top_logprobs)
                            if with_logprobs else None,
                            "lorarl": {"token_ids": c.token_ids, "versions": c.versions}})
        completion_tokens = sum(len(c.token_ids) for c in result.completions)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                                              "total_tokens": len(prompt) + completion_tokens}}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        parsed: CompletionBody = parse(CompletionBody, body)
        try:
            prompts = parsed.prompts()
        except ValueError as e:
            raise HttpError(400, str(e), "prompt") from None
        ids = [endpoint.renderer.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p
               for p in prompts]
        params, with_logprobs = sampling_params(parsed)
        stops = parsed.stops()
        model = parsed.model
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generate = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=i) for i in ids],
                                               sampling=params, policy=endpoint.policy(model), request_id=request_id)
        if parsed.stream:
            if len(ids) > 1:
                raise HttpError(400, "stream with several prompts is not served: send one prompt per request",
                                "prompt")
            stream_input = validation.stream_input(_stream_request(generate), endpoint.limits(), None)  # before 200
            return StreamingResponse(stream_completion(endpoint, stream_input, request_id, str(model), stops),
                                     media_type="text/event-stream")
        results = await endpoint.core.generate(validation.generate_input(generate, endpoint.limits(), None))
        tokenizer = endpoint.renderer.tokenizer
        choices = []
        completion_tokens = 0
        for p, result in enumerate(results):  # OpenAI's order: prompt by prompt, n choices each
            head = (prompts[p] if isinstance(prompts[p], str) else endpoint.renderer.decode(ids[p])) if parsed.echo \
                else ""
            for j, c in enumerate(result.completions):
                if parsed.max_tokens == 0:  # echo alone: the token generated to get there is not returned
                    c.token_ids, c.logprobs, c.versions, c.top_logprobs, c.finish = [], [], [], [], Finish.LENGTH
                completion_tokens += len(c.token_ids)
                text, stopped = cut_at_stop(endpoint.renderer.decode(c.token_ids), stops)
                logprobs = None
                if with_logprobs:
                    tops = c.top_logprobs or [{} for _ in c.token_ids]
                    logprobs = text_logprobs(tokenizer, c.token_ids, c.logprobs, tops, len(head))
                    if parsed.echo:
                        prompt_part = echoed(tokenizer, ids[p], result)
                        logprobs = {key: prompt_part[key] + logprobs[key] for key in logprobs}
                choices.append({"index": p * parsed.n + j, "text": head + text,
                                "finish_reason": "length" if c.finish is Finish.LENGTH and not stopped else "stop",
                                "logprobs": logprobs, "lorarl": {"token_ids": c.token_ids, "versions": c.versions}})
        prompt_tokens = sum(len(i) for i in ids)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}

    return app


# ------------------------------------------------------------------------------------------------ streams


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def _stream_request(generate: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateStreamRequest:
    return rollout_pb2.GenerateStreamRequest(prompt=generate.prompts[0], sampling=generate.sampling,
                                             policy=generate.policy, request_id=generate.request_id)


def _held(text: str, stops: Sequence[str], final: bool) -> tuple[str, bool]:
    """What of a streamed text may be sent now: cut at a stop string; until the end, the tail that could
    still become one is held back."""
    text, stopped = cut_at_stop(text, stops)
    if stopped or final or not stops:
        return text, stopped
    hold = max(len(s) for s in stops) - 1
    return (text[:-hold] if hold else text), False


async def stream_chat(endpoint: Endpoint, request_input: Any, request_id: str, model: str,
                      with_tools: bool, with_logprobs: bool, include_usage: bool, remember,
                      stops: Sequence[str] = ()) -> AsyncIterator[bytes]:
    """Chat chunks as tokens arrive; text from a ``<tool_call>`` on is held back and sent as ``tool_calls``,
    and so is a tail that may turn out to be a stop string."""
    created = int(time.time())
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    n = request_input.sampling.n
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    versions: list[list[int]] = [[] for _ in range(n)]
    sent = [0] * n  # characters of content already sent
    finished: list[tuple[Completion, dict, str]] = []  # recorded once the stream is done (and its room freed)
    for index in range(n):
        yield _sse({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
    async for chunk in endpoint.core.generate_stream(request_input):
        i = chunk.index
        tokens[i] += chunk.token_ids
        logprobs[i] += chunk.logprobs
        versions[i] += chunk.versions
        text, _ = _held(endpoint.renderer.decode(tokens[i]), stops, chunk.finish is not None)
        held = text.find(OPEN) if with_tools else -1
        visible = text if held < 0 else text[:held]
        if len(visible) > sent[i] and not visible.endswith("\ufffd"):
            delta: dict[str, Any] = {"content": visible[sent[i]:]}
            sent[i] = len(visible)
            choice: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": None}
            if with_logprobs:
                choice["logprobs"] = chat_logprobs(endpoint.renderer, chunk.token_ids, chunk.logprobs,
                                                   chunk.top_logprobs)
            yield _sse({**base, "choices": [choice]})
        if chunk.finish is not None:
            content, calls = parse_tool_calls(text) if with_tools else (text, [])
            if calls:
                yield _sse({**base, "choices": [{"index": i, "delta": {"tool_calls": [
                    {"index": k, **call} for k, call in enumerate(calls)]}, "finish_reason": None}]})
            elif len(text) > sent[i]:
                yield _sse({**base, "choices": [{"index": i, "delta": {"content": text[sent[i]:]},
                                                 "finish_reason": None}]})
            reason = finish_reason(chunk.finish, calls)
            reply = {"role": "assistant", "content": content if (content or not calls) else None,
                     **({"tool_calls": calls} if calls else {})}
            finished.append((Completion(tokens[i], logprobs[i], versions[i]), reply, reason))
            yield _sse({**base, "choices": [{"index": i, "delta": {}, "finish_reason": reason,
                                             "lorarl": {"token_ids": tokens[i], "versions": versions[i]}}]})
    for completion, reply, reason in finished:  # a scored session's turn is scored here: before [DONE]
        try:
            await remember(completion, reply, reason)
        except Exception as e:  # the 200 is sent: the stream ends with OpenAI's error event, the turn unrecorded
            field = getattr(e, "field", None)
            message = f"{TEACHERS_HEADER}: the turn was sampled but its teachers could not score it, so the " \
                      f"session does not record it: {f'{field}: ' if field else ''}{e}"
            logger.warning("stream %s: %s", request_id, message)
            yield _sse({"error": {"message": message, "type": "server_error", "param": TEACHERS_HEADER,
                                  "code": STATUS.get(type(e), 500)}})
            return
    if include_usage:
        completion = sum(len(t) for t in tokens)
        prompt = len(request_input.prompts[0])
        yield _sse({**base, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                     "total_tokens": prompt + completion}})
    yield b"data: [DONE]\n\n"


async def stream_completion(endpoint: Endpoint, request_input: Any, request_id: str,
                            model: str, stops: Sequence[str] = ()) -> AsyncIterator[bytes]:
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    tokens: dict[int, list[int]] = {}
    sent: dict[int, int] = {}
    async for chunk in endpoint.core.generate_stream(request_input):
        i = chunk.index
        tokens.setdefault(i, []).extend(chunk.token_ids)
        text, stopped = _held(endpoint.renderer.decode(tokens[i]), stops, chunk.finish is not None)
        delta = "" if text.endswith("\ufffd") and chunk.finish is None else text[sent.get(i, 0):]
        sent[i] = sent.get(i, 0) + len(delta)
        reason = None if chunk.finish is None else (
            "length" if chunk.finish is Finish.LENGTH and not stopped else "stop")
        if delta or reason:
            yield _sse({**base, "choices": [{"index": i, "text": delta, "finish_reason": reason, "logprobs": None}]})
    yield b"data: [DONE]\n\n"
