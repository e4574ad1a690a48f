"""The turns of each session (an agent's episode), with the exact tokens that were sampled.

An agent sends its whole conversation with every call; re-rendering it from text would give the earlier
assistant turns back as the chat template writes them, not as the policy sampled them (other whitespace,
other JSON spacing), and the episode's tokens would no longer be the ones it was trained on. So a call
whose messages continue an earlier turn of the same session (that turn's messages, then its assistant
reply) is answered from that turn's exact tokens plus the new messages rendered after them: the session
is one growing token sequence, and `lorarl.client.workflow.session_episodes` turns it into a trajectory
with the environment's tokens masked.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


def normalized(message: dict[str, Any]) -> tuple:
    """What identifies a message: role, text (stripped), tool calls (id, name, canonical arguments), tool
    call id. The ids tell apart the branches of an ``n > 1`` reply that differ only in spacing."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.dumps(json.loads(arguments), sort_keys=True) if isinstance(arguments, str) else \
                json.dumps(arguments, sort_keys=True)
        calls.append((call.get("id") or "", function.get("name"), arguments))
    content = message.get("content") or ""
    return message.get("role"), content.strip() if isinstance(content, str) else content, tuple(calls), \
        message.get("tool_call_id") or ""


@dataclass
class Turn:
    """One sampled completion of a session: what it was asked, what it returned, its exact tokens."""

    messages: list[tuple]  # the request's messages, normalized
    tools: str  # the request's tools as canonical JSON ("" when none)
    reply: tuple  # the assistant message returned, normalized
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    model: str
    #: per token, the log of its teachers' weighted probability (a scored session: X-Lorarl-Teachers), else None
    teacher_logprobs: list[float] | None = None
    teacher_seconds: float = 0.0  # this replica's time scoring it

    def as_json(self) -> dict[str, Any]:
        out = {"prompt_token_ids": self.prompt_ids, "token_ids": self.token_ids, "logprobs": self.logprobs,
               "versions": self.versions, "finish_reason": self.finish_reason, "model": self.model}
        if self.teacher_logprobs is not None:
            out.update(teacher_logprobs=self.teacher_logprobs, teacher_seconds=self.teacher_seconds)
        return out


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)
    touched: float = field(default_factory=time.monotonic)


class SessionStore:
    """Sessions by id, least recently used dropped past ``max_sessions`` or after ``ttl_s`` idle."""

    def __init__(self, max_sessions: int = 4096, max_turns: int = 256, ttl_s: float = 3600.0) -> None:
        self.max_sessions, self.max_turns, self.ttl_s = max_sessions, max_turns, ttl_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._sessions:
            oldest_id, oldest = next(iter(self._sessions.items()))
            if len(self._sessions) <= self.max_sessions and now - oldest.touched <= self.ttl_s:
                break
            del self._sessions[oldest_id]

    def record(self, session_id: str, turn: Turn) -> None:
        session = self._sessions.pop(session_id, None) or Session()
        session.turns = [*session.turns, turn][-self.max_turns:]
        session.touched = time.monotonic()
        self._sessions[session_id] = session
        self._expire()

    def turns(self, session_id: str) -> list[Turn] | None:
        self._expire()
        session = self._sessions.get(session_id)
        return None if session is None else list(session.turns)

    def pop(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def continued(self, session_id: str, messages: list[tuple], tools: str) -> tuple[Turn, int] | None:
        """The latest turn that ``messages`` continue (its messages, then its own reply) and where the new
        messages start; None when none does (the conversation is rendered from its text)."""
        session = self._sessions.get(session_id)
        for turn in reversed(session.turns if session else []):
            k = len(turn.messages)
            if turn.tools == tools and len(messages) > k + 1 and messages[:k] == turn.messages \
                    and messages[k] == turn.reply:
                return turn, k + 1
        return None
