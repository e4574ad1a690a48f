"""One trajectory as the trainer learns from it: plain data, below every engine and the RL step."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorarl.contract.routes import RoutedExperts


@dataclass
class TrajectoryRecord:
    """One completion and what the trainer needs to learn from it; mirrors lorarl.v1.Trajectory.

    ``behavior_logprobs`` and ``token_versions`` hold one entry per completion token. An empty
    ``group_id`` groups the trajectory with those sharing its exact prompt. ``loss_mask`` (one bool per
    completion token; None: all True) marks the tokens the policy sampled: a multi-turn episode's tool
    and environment tokens are False, conditioned on but never trained, their logprobs and versions unread.
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    reward: float
    group_id: str = ""
    finish_reason: str = "stop"
    id: str = ""
    loss_mask: list[bool] | None = None
    turn_rewards: list[float] = field(default_factory=list)  # per policy turn; informational
    # Per completion token: the caller's advantage (cross_entropy: weight), for the losses that take them
    # (lorarl.contract.training.TOKEN_LOSSES); None: none given.
    token_advantages: list[float] | None = None
    # The experts the rollout's MoE routers chose at each position of prompt + completion but the last
    # (lorarl.contract.routes), for routing replay; None: not recorded. ``routes_problem``: why the routes sent
    # could not be read (validation refuses the trajectory with it).
    routes: RoutedExperts | None = None
    routes_problem: tuple[str, str] | None = None
    # Version -> fingerprint of the weights the rollout served it with (lorarl.v1.Trajectory.policy_fingerprints).
    fingerprints: dict[int, str] = field(default_factory=dict)
    # Per completion token: the sampled token's logprob under the prompt's teacher (on-policy distillation,
    # LossSpec.distills); None: not scored. ``teacher``: which one, for metrics.
    teacher_logprobs: list[float] | None = None
    teacher: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.completion_token_ids)

    @property
    def trained_tokens(self) -> int:
        """Completion tokens the loss reads: the policy's own."""
        return len(self.completion_token_ids) if self.loss_mask is None else sum(map(bool, self.loss_mask))

    def policy_turns(self) -> int:
        """Runs of policy tokens: one for a single turn, one per assistant turn of an episode."""
        mask = self.trained()
        return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))

    def trained(self) -> list[bool]:
        """The loss mask, one entry per completion token."""
        return [True] * len(self.completion_token_ids) if self.loss_mask is None else [bool(m) for m in self.loss_mask]

    def group_key(self) -> str | tuple[int, ...]:
        return self.group_id or tuple(self.prompt_token_ids)
