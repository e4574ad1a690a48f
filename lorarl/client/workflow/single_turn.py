"""The single-turn GRPO episode: one prompt, a group of sampled completions, a reward each.

What `lorarl run examples/demo.yaml` trains; every other workflow is written the same way
(lorarl.client.workflow.api).
"""

from __future__ import annotations

from lorarl.client.job.datasets import Example
from lorarl.client.workflow.api import Episode, EpisodeContext, Workflow


class SingleTurn(Workflow):
    """The example's prompt, ``ctx.group_size`` completions of it, each scored by the job's reward."""

    async def run(self, ctx: EpisodeContext, example: Example) -> list[Episode]:
        prompt = ctx.prompt_ids(example)
        samples = await ctx.sample(prompt, n=ctx.group_size)
        rewards = await ctx.score(example, [s.text for s in samples])
        episodes = []
        for sampled, reward in zip(samples, rewards, strict=True):
            episode = Episode(prompt)
            episode.add_policy(sampled)
            episode.reward = reward
            episodes.append(episode)
        return episodes
