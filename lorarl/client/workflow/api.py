"""What an episode is made of, and the interface a user implements to define one.

A workflow turns one example (a row of the job's data) into trajectories: it renders prompts, samples
from the policy through its context, lets tools or an environment answer, and scores. The loop does not
know what happens inside; it runs many episodes at once, hands each a context pinned to the policy
version that was serving when the episode was admitted, and sends what comes back to the trainer.

    class MyAgent(Workflow):
        async def run(self, ctx: EpisodeContext, example: Example) -> list[Episode]:
            ids = ctx.render([{"role": "user", "content": example.prompt}], tools=TOOLS)
            episode = Episode(ids)
            turn = (await ctx.sample(episode.token_ids))[0]
            episode.add_policy(turn)
            ...                                   # call the tool the turn asked for
            episode.add_context(ctx.render_followup([{"role": "tool", "content": result}]))
            (episode.reward,) = await ctx.score(example, [final_text])
            return [episode]

An `Episode` keeps the exact token ids: the policy's turns (trained, with the logprobs and versions the
rollout reported) and everything else (tool results, user turns, chat-template glue: conditioned on,
never trained) in one sequence with its loss mask, so nothing is re-tokenized from text.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lorarl.client.job.datasets import Example
from lorarl.contract.routes import RoutedExperts
from lorarl.v1 import common_pb2


@dataclass(frozen=True)
class Sampled:
    """One completion the policy sampled: its tokens, their logprobs and the versions that made them."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str = ""
    finish_reason: int = common_pb2.FINISH_REASON_STOP
    #: The experts the rollout's routers chose at every position of its prompt + these tokens but the last (MoE
    #: replicas that record routes; None: not recorded).
    routes: RoutedExperts | None = None
    #: The fingerprint of the weights each version served it with (the trainer checks them)
    fingerprints: dict[int, str] = field(default_factory=dict)
    #: Per token, its logprob under the episode's teacher(s) (on-policy distillation); None: not scored.
    teacher_logprobs: list[float] | None = None

    @classmethod
    def from_proto(cls, c: Any) -> Sampled:
        """A lorarl.v1.Completion (RoutesError if its routes are malformed)."""
        return cls(list(c.token_ids), list(c.logprobs), list(c.token_versions), c.text, c.finish_reason,
                   RoutedExperts.from_proto(c.routed_experts) if c.HasField("routed_experts") else None,
                   dict(c.policy_fingerprints), list(c.teacher_logprobs) if c.teacher_logprobs else None)


@dataclass
class Episode:
    """One trajectory built turn by turn: a prompt, then policy turns and context (tool/environment) turns."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_STOP
    group_id: str = ""  # empty: the loop groups an example's episodes together (GRPO's group)
    metrics: dict[str, float] = field(default_factory=dict)
    #: Routed experts by position of the whole sequence: each policy turn's, later turns laid over earlier ones
    #: (a turn's request recomputes every earlier position: those are what its tokens were sampled under).
    routes: RoutedExperts | None = None
    fingerprints: dict[int, str] = field(default_factory=dict)  # each serving version's weights (its turns')
    #: Per completion token, the teacher's logprob (its policy turns'; 0 on context tokens, never read): set when
    #: the turns were scored by teachers (on-policy distillation), None otherwise. ``teacher``: who scored them.
    teacher_logprobs: list[float] | None = None
    teacher: str = ""

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if not self.prompt_ids:
            raise ValueError("an episode needs a prompt of at least one token")

    @property
    def token_ids(self) -> list[int]:
        """The whole sequence so far: what the policy's next turn is conditioned on."""
        return self.prompt_ids + self.completion_ids

    @property
    def policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def policy_turns(self) -> list[list[int]]:
        """The token ids of each run of policy tokens (each turn the policy sampled), in order."""
        turns: list[list[int]] = []
        for i, (token, trained) in enumerate(zip(self.completion_ids, self.loss_mask, strict=True)):
            if trained:
                if i == 0 or not self.loss_mask[i - 1]:
                    turns.append([])
                turns[-1].append(token)
        return turns

    def add_policy(self, sampled: Sampled, reward: float | None = None) -> None:
        """Appends a turn the policy sampled (trained); ``reward``: this turn's own, if the episode gives them."""
        n = len(sampled.token_ids)
        if len(sampled.logprobs) != n or len(sampled.versions) != n:
            raise ValueError(f"a sampled turn needs one logprob and one version per token ({n} tokens, "
                             f"{len(sampled.logprobs)} logprobs, {len(sampled.versions)} versions)")
        scored = sampled.teacher_logprobs is not None
        if scored and len(sampled.teacher_logprobs) != n:
            raise ValueError(f"a scored turn needs one teacher logprob per token ({n} tokens, "
                             f"{len(sampled.teacher_logprobs)} teacher logprobs)")
        if any(self.loss_mask) and scored != (self.teacher_logprobs is not None):
            raise ValueError("an episode's policy turns are all scored by teachers or none is")
        if scored:
            self.teacher_logprobs = (self.teacher_logprobs or [0.0] * len(self.completion_ids)) + \
                list(sampled.teacher_logprobs)
        self.completion_ids += sampled.token_ids
        self.loss_mask += [True] * n
        self.logprobs += sampled.logprobs
        self.versions += sampled.versions
        self.finish_reason = sampled.finish_reason
        if sampled.routes is not None:
            self.routes = sampled.routes if self.routes is None else self.routes.overlay(sampled.routes)
        self.fingerprints.update(sampled.fingerprints)
        if reward is not None:
            self.turn_rewards.append(float(reward))

    def add_context(self, token_ids: Sequence[int]) -> None:
        """Appends tokens the policy did not sample (a tool's result, the environment, a user): conditioned on,
        never trained."""
        ids = [int(t) for t in token_ids]
        self.completion_ids += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        if self.teacher_logprobs is not None:
            self.teacher_logprobs += [0.0] * len(ids)
        self.versions += [0] * len(ids)

    def to_proto(self, job_id: str, trajectory_id: str, group_id: str) -> common_pb2.Trajectory:
        """The trainer's contract; a single-turn episode (every token the policy's) sends no mask."""
        single = all(self.loss_mask)
        out = common_pb2.Trajectory(
            id=trajectory_id, job_id=job_id, group_id=self.group_id or group_id, prompt_token_ids=self.prompt_ids,
            completion_token_ids=self.completion_ids, behavior_logprobs=self.logprobs, token_versions=self.versions,
            reward=self.reward, finish_reason=self.finish_reason, loss_mask=[] if single else self.loss_mask,
            turn_rewards=self.turn_rewards, metrics=self.metrics, policy_fingerprints=self.fingerprints,
            teacher_logprobs=self.teacher_logprobs or [], teacher=self.teacher)
        if self.routes is not None:  # context tokens after the last turn were never computed: not recorded
            out.routed_experts.CopyFrom(self.routes.truncated(len(self.token_ids) - 1).to_proto())
        return out


class EpisodeContext(abc.ABC):
    """What an episode may do: sample from its pinned policy, render chat turns, score. One per episode."""

    #: The policy version every sample of this episode asks for (0: the base model).
    version: int
    #: Completions per prompt the job asks for (its GRPO group size; 1 in evaluation).
    group_size: int
    #: True while the loop evaluates held-out examples (greedy sampling, nothing is trained).
    evaluating: bool

    @abc.abstractmethod
    async def sample(self, prompt_ids: Sequence[int], n: int = 1, *, max_tokens: int | None = None,
                     temperature: float | None = None, stop: Sequence[str] = ()) -> list[Sampled]:
        """``n`` completions of ``prompt_ids`` from the pinned policy (the job's sampling settings by default)."""

    @abc.abstractmethod
    def prompt_ids(self, example: Example) -> list[int]:
        """The example's prompt as the job renders it (chat template, system prompt, thinking switch)."""

    @abc.abstractmethod
    def render(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat, with the model's chat template (and its tool format)."""

    @abc.abstractmethod
    def render_followup(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None
                        ) -> list[int]:
        """Token ids that follow a policy turn which ended with its end-of-turn token: the template's glue,
        ``messages`` (tool results, a user turn) and the opening of the next assistant turn."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, no special tokens added."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens dropped."""

    @abc.abstractmethod
    async def score(self, example: Example, completions: Sequence[str]) -> list[float]:
        """The job's reward for each of ``completions`` of ``example`` (one call for a batched reward;
        failures scored and counted as the job says)."""


class Workflow(abc.ABC):
    """An episode, defined once: the job file names the class (``workflow.name: package.module:Class``) and
    its keyword settings (``workflow.settings``)."""

    def __init__(self, **settings: Any) -> None:
        if settings:
            raise TypeError(f"{type(self).__name__} takes no settings, got {sorted(settings)}")

    @abc.abstractmethod
    async def run(self, ctx: EpisodeContext, example: Example) -> list[Episode]:
        """The example's episodes: their rewards set, ready for the trainer (an empty list trains nothing)."""
