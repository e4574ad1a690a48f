"""The calculator agent of examples/agent-tools.yaml, written as agent code for any OpenAI-compatible
server: it asks the policy (through the official ``openai`` client, on the rollout's endpoint), runs the
tool calls it makes, sends the results back and takes the next answer. lorarl trains on what the session
recorded: the policy's turns, with the tool's replies masked."""

from __future__ import annotations

import asyncio
import json

from lorarl.assets.tool_task import TOOLS, calculate
from lorarl.client.workflow import Episode, Workflow


class CalcAgent(Workflow):
    """``ctx.group_size`` conversations per example: ask; if the policy calls calc, answer with its result."""

    def __init__(self, call_tokens: int = 96, answer_tokens: int = 12) -> None:
        self.call_tokens, self.answer_tokens = call_tokens, answer_tokens

    async def run(self, ctx, example) -> list[Episode]:
        client = ctx.openai_client()
        messages = [{"role": "user", "content": example.prompt}]
        first = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS,
                                                     n=ctx.group_size, max_tokens=self.call_tokens,
                                                     temperature=ctx.temperature)

        async def follow(choice) -> None:
            calls = choice.message.tool_calls or []
            if not calls:
                return  # answered without the tool: the episode ends here
            results = []
            for call in calls:
                try:
                    expr = json.loads(call.function.arguments).get("expr", "")
                except (json.JSONDecodeError, AttributeError):
                    expr = ""
                results.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expr)})
            await client.chat.completions.create(
                model=ctx.model, messages=[*messages, choice.message.model_dump(exclude_none=True), *results],
                tools=TOOLS, max_tokens=self.answer_tokens, temperature=ctx.temperature)

        await asyncio.gather(*(follow(choice) for choice in first.choices))
        episodes = await ctx.session_episodes()
        finals = [ctx.decode(episode.policy_turns()[-1]) for episode in episodes]
        for episode, reward in zip(episodes, await ctx.score(example, finals), strict=True):
            episode.reward = reward
        return episodes
