"""What the RL loop and the rollout's OpenAI-compatible endpoint agree on about an agent's session.

An episode's agent talks to the endpoint with the ``openai`` client; the loop's ``ctx.openai_client`` marks its calls
with the episode's session (``X-Session-Id``: the endpoint keeps the turns' exact tokens under it) and, in on-policy
distillation, with the teachers that score each turn (``X-Lorarl-Teachers``: a JSON list of ``{job_id, version,
engine, weight}``, one per teacher, as GenerateRequest.teachers and Prompt.teacher_weights carry them). The endpoint
reads both (lorarl.rollout.openai), the loop writes them (lorarl.client.workflow.context).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from lorarl.v1 import rollout_pb2

SESSION_HEADER = "X-Session-Id"
TEACHERS_HEADER = "X-Lorarl-Teachers"


def teachers_header(teachers: Sequence[rollout_pb2.PolicySelector], weights: Sequence[float]) -> str:
    """The ``X-Lorarl-Teachers`` value for these teachers, each with its weight for the session's prompt."""
    return json.dumps([{"job_id": t.job_id, "version": t.version, "engine": t.engine, "weight": float(w)}
                       for t, w in zip(teachers, weights, strict=True)])
