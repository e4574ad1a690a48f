"""The student's workflow (student.yaml): each row's episode as its domain's expert job ran it. A ``tools`` row is
the calculator agent of examples/multitenant/tools.yaml (multi-turn, through the rollout's OpenAI-compatible
endpoint, its turns scored by the row's teacher there); any other row is the single-turn episode of
examples/multitenant/sort.yaml. A job's workflow is imported with its job file's folder first on the import path,
and the agent lives one folder up."""

from __future__ import annotations

import sys
from pathlib import Path

from lorarl.assets.mixed_task import TOOLS
from lorarl.client.job.datasets import Example
from lorarl.client.workflow import Episode, EpisodeContext, Workflow
from lorarl.client.workflow.single_turn import SingleTurn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from calc_agent import CalcAgent


class SortOrTool(Workflow):
    """The calculator agent for rows whose ``task`` is ``tools``, one turn for the others."""

    def __init__(self) -> None:
        self.agent, self.single_turn = CalcAgent(), SingleTurn()

    async def run(self, ctx: EpisodeContext, example: Example) -> list[Episode]:
        workflow = self.agent if example.columns.get("task") == TOOLS else self.single_turn
        return await workflow.run(ctx, example)
