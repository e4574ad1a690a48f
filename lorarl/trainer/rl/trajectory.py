"""One trajectory as the trainer learns from it: plain data, below every engine and the RL step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrajectoryRecord:
    """One completion and what the trainer needs to learn from it; mirrors lorarl.v1.Trajectory.

    ``behavior_logprobs`` and ``token_versions`` hold one entry per completion token. An empty
    ``group_id`` groups the trajectory with those sharing its exact prompt.
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    reward: float
    group_id: str = ""
    finish_reason: str = "stop"
    id: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.completion_token_ids)

    def group_key(self) -> str | tuple[int, ...]:
        return self.group_id or tuple(self.prompt_token_ids)
