"""An agent's session on the rollout's OpenAI-compatible endpoint, as trajectories for the trainer.

The endpoint keeps every turn of a session with its exact tokens (lorarl.rollout.openai.sessions): a turn
that continues an earlier one has that turn's prompt and completion as the start of its own prompt, and
what comes after them is what the environment added (a tool's result, a user's reply). Chained turns are
one trajectory: the policy's completions trained, the environment's tokens masked. A turn that does not
continue the one before (the agent rewrote its history, or ran a side conversation) starts a trajectory of
its own. A session the loop asked teachers to score (on-policy distillation) carries each turn's teacher
logprobs, which become the trajectory's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lorarl.client.workflow.api import Episode, Sampled
from lorarl.v1 import common_pb2

FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "tool_calls": common_pb2.FINISH_REASON_STOP,
          "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}


def session_episodes(turns: Sequence[Mapping[str, Any]]) -> list[Episode]:
    """``GET /v1/sessions/{id}``'s turns -> one Episode per chain of turns (rewards left to the workflow)."""
    episodes: list[Episode] = []
    for turn in turns:
        prompt, tokens = list(turn["prompt_token_ids"]), list(turn["token_ids"])
        scored = turn.get("teacher_logprobs")  # a scored session's (on-policy distillation)
        sampled = Sampled(tokens, list(turn["logprobs"]), list(turn["versions"]),
                          finish_reason=FINISH.get(turn.get("finish_reason", "stop"), common_pb2.FINISH_REASON_STOP),
                          teacher_logprobs=list(scored) if scored is not None else None)
        current = _continued(episodes, prompt)
        if current is None:
            current = Episode(prompt)
            episodes.append(current)
        else:
            current.add_context(prompt[len(current.token_ids):])
        current.add_policy(sampled)
    return episodes


def _continued(episodes: list[Episode], prompt: list[int]) -> Episode | None:
    """The episode ``prompt`` extends (its whole sequence is a prefix of it), latest first."""
    for episode in reversed(episodes):
        sequence = episode.token_ids
        if len(prompt) >= len(sequence) and prompt[: len(sequence)] == sequence:
            return episode
    return None
