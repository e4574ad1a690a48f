"""The context an episode runs in: the rollout replicas behind one policy version, the job's chat
rendering, and its reward. The loop makes one per episode (lorarl.client.workflow.api.EpisodeContext).

Pinning. Every sample of an episode asks for the version that served when the episode was admitted, so
a multi-turn episode is one policy's from its first turn to its last. A replica serving adapters keeps
the last few versions loaded (rollout.adapter_window); merged weights hold one version only, so once a
newer one replaces it (or a version left the window) the episode carries on with the latest, counted in
``unpinned``: its tokens still carry the versions that made them, and the trainer's staleness bound masks
any that are too old. Agent code on the OpenAI-compatible endpoint asks for ``ctx.model`` (``job:vN``)
and has no such fallback: run agent jobs in adapter mode, whose window holds the versions in flight.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from lorarl.client.calls import ServiceCallError
from lorarl.client.job.datasets import Example
from lorarl.client.job.rewards import Reward
from lorarl.client.workflow.agent_http import AgentHttp
from lorarl.client.workflow.api import Episode, EpisodeContext, Sampled
from lorarl.client.workflow.coalesce import CoalescingRollout
from lorarl.client.workflow.sessions import session_episodes
from lorarl.contract.agent_sessions import SESSION_HEADER, TEACHERS_HEADER, teachers_header
from lorarl.contract.chat import ChatRenderer
from lorarl.v1 import common_pb2, rollout_pb2

#: What a replica answers for a pinned version it no longer serves (NOT_FOUND: not loaded; FAILED_PRECONDITION:
#: the base model once merged weights replaced it).
_GONE = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass(frozen=True)
class SamplingDefaults:
    """The job's sampling settings, which an episode's samples use unless it says otherwise."""

    temperature: float
    top_p: float
    max_tokens: int


class RolloutContext(EpisodeContext):
    """An EpisodeContext over the rollout service (or a pool of replicas)."""

    def __init__(self, rollout: Any, job_id: str, version: int, renderer: ChatRenderer, reward: Reward,
                 sampling: SamplingDefaults, group_size: int, *, seed: int, request_id: str,
                 evaluating: bool = False, batch: str = "", openai_url: str = "", token: str | None = None,
                 http: AgentHttp | None = None, teachers: Sequence[rollout_pb2.PolicySelector] = (),
                 teacher_weights: Sequence[float] = ()) -> None:
        self.rollout, self.job_id, self.version = rollout, job_id, version
        self.renderer, self.reward, self.sampling = renderer, reward, sampling
        self.group_size, self.evaluating = group_size, evaluating
        self.seed, self.request_id, self.batch = seed, request_id, batch
        self.openai_url, self.token = openai_url, token
        self.http = http or AgentHttp()  # the loop passes its own, shared by all its episodes
        # on-policy distillation: the teachers that score every sample of this episode, and each one's weight
        self.teachers, self.teacher_weights = list(teachers), list(teacher_weights)
        self.teacher_seconds = 0.0  # the replicas' time scoring this episode's samples
        self._nonce = uuid.uuid4().hex[:8]
        self.calls = 0  # samples asked for; each gets its own seed and request id
        self.unpinned = 0  # samples served by a later version than the pinned one
        self.reward_errors = 0  # samples this episode scored 0 for a failed reward

    def _policy(self, pinned: bool) -> rollout_pb2.PolicySelector:
        if not pinned:
            return rollout_pb2.PolicySelector(job_id=self.job_id)
        if self.version == 0:  # the base model: a fresh adapter is the identity
            return rollout_pb2.PolicySelector()
        return rollout_pb2.PolicySelector(job_id=self.job_id, version=self.version)

    async def sample(self, prompt_ids: Sequence[int], n: int = 1, *, max_tokens: int | None = None,
                     temperature: float | None = None, stop: Sequence[str] = ()) -> list[Sampled]:
        call = self.calls
        self.calls += 1
        params = common_pb2.SamplingParams(
            n=n, temperature=self.sampling.temperature if temperature is None else temperature,
            top_p=self.sampling.top_p, max_tokens=max_tokens or self.sampling.max_tokens, stop=list(stop),
            seed=self.seed + 7919 * call)
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=list(prompt_ids), teacher_weights=self.teacher_weights)],
            sampling=params, request_id=f"{self.request_id}-s{call}", teachers=self.teachers)
        request.policy.CopyFrom(self._policy(pinned=True))
        try:
            response = await self._generate(request)
        except ServiceCallError as e:
            if e.code not in _GONE:
                raise
            request.policy.CopyFrom(self._policy(pinned=False))
            response = await self._generate(request)
            self.unpinned += 1
        (result,) = response.results
        self.teacher_seconds += response.teacher_seconds
        return [Sampled.from_proto(c) for c in result.completions]

    async def _generate(self, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        if isinstance(self.rollout, CoalescingRollout):
            return await self.rollout.Generate(request, group=self.batch)
        return await self.rollout.Generate(request)

    def prompt_ids(self, example: Example) -> list[int]:
        return self.renderer.prompt_ids(example.prompt)

    @property
    def temperature(self) -> float:
        """The job's sampling temperature (0 while evaluating: greedy)."""
        return self.sampling.temperature

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    # ------------------------------------------------------------ agents on the OpenAI-compatible endpoint

    @property
    def session_id(self) -> str:
        """This episode's session: unique per attempt, so a batch redone after a fault starts clean."""
        return f"{self.request_id}-{self._nonce}"

    @property
    def model(self) -> str:
        """The ``model`` that asks the endpoint for this episode's pinned policy."""
        return "base" if self.version == 0 else f"{self.job_id}:v{self.version}"

    def openai_client(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` on this episode's replica, its calls in this episode's session."""
        if not self.openai_url:
            raise RuntimeError("no OpenAI-compatible endpoint: set rollout.openai: true in the job (lorarl run), or "
                               "pass --openai to lorarl train")
        import openai

        headers = {SESSION_HEADER: self.session_id, **self._teacher_header(), **kwargs.pop("default_headers", {})}
        kwargs.setdefault("http_client", self.http.client())
        return openai.AsyncOpenAI(base_url=self.openai_url, api_key=self.token or "none", default_headers=headers,
                                  **kwargs)

    def _teacher_header(self) -> dict[str, str]:
        """On-policy distillation: the endpoint scores each of this episode's turns by its teachers, in the
        replica's engine, and keeps the scores with the turn (X-Lorarl-Teachers, lorarl.rollout.openai.app)."""
        return {TEACHERS_HEADER: teachers_header(self.teachers, self.teacher_weights)} if self.teachers else {}

    async def session_episodes(self, forget: bool = True) -> list[Episode]:
        """What the agent sampled in this episode's session, as trajectories (the environment's tokens masked);
        ``forget``: the replica drops the session once read."""
        url = f"{self.openai_url}/sessions/{self.session_id}"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        http = self.http.client()
        reply = await http.get(url, headers=headers, timeout=60)
        if reply.status_code == 404:
            return []
        reply.raise_for_status()
        turns = reply.json()["turns"]
        if forget:  # read for the last time: its scoring time counted once
            await http.delete(url, headers=headers, timeout=60)
            self.teacher_seconds += sum(float(t.get("teacher_seconds", 0.0)) for t in turns)
        return session_episodes(turns)

    def render(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
        return self.renderer.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def render_followup(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None
                        ) -> list[int]:
        return self.renderer.render_followup(messages, tools=tools)

    def encode(self, text: str) -> list[int]:
        return self.renderer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.renderer.decode(token_ids)

    async def score(self, example: Example, completions: Sequence[str]) -> list[float]:
        scores, failed = await self.reward.score(example, completions)
        self.reward_errors += failed
        return scores
