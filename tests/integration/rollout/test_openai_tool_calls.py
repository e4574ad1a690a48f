"""Tool calls through the rollout's OpenAI-compatible endpoint on real vLLM, with the official `openai`
client: the shipped tool-using policy (qwen3-tiny-tools) calls the calculator, the client sees OpenAI
`tool_calls`, the agent answers with the tool's result, and the session's trajectory is exactly the tokens
the engine generated for both turns, the tool's reply between them masked."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from lorarl.assets.paths import TOOLS_MODEL_DIR
from lorarl.assets.tool_task import TOOLS, calculate
from lorarl.client.workflow.sessions import session_episodes
from lorarl.contract.chat import ChatRenderer
from lorarl.rollout.openai.http_server import OpenAIServer
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import TOKEN, RolloutHarness, openai_served

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[RolloutHarness, OpenAIServer]]:
    with openai_served(TOOLS_MODEL_DIR) as served:
        yield served


def test_a_tool_call_round_trip_is_the_engines_tokens(served) -> None:
    harness, server = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=TOKEN, max_retries=0)
    messages = [{"role": "user", "content": "328*25="}]
    first = client.chat.completions.create(model="base", messages=messages, tools=TOOLS, max_tokens=96,
                                           temperature=0, user="calc-1")
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "328*25"}
    result = calculate(json.loads(call.function.arguments)["expr"])
    follow = [*messages, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model="base", messages=follow, tools=TOOLS, max_tokens=12,
                                            temperature=0, user="calc-1")
    assert second.choices[0].finish_reason == "stop"

    turns = harness.call(_turns(server, "calc-1"))
    (episode,) = session_episodes(turns)
    renderer = ChatRenderer(str(TOOLS_MODEL_DIR))
    prompt = renderer.render(messages, tools=TOOLS)
    assert episode.prompt_ids == prompt
    # what the engine generates, over gRPC, from the same token ids
    engine_first = _greedy(harness, prompt, 96)
    context = renderer.render_followup([{"role": "tool", "tool_call_id": call.id, "content": result}], tools=TOOLS)
    engine_second = _greedy(harness, [*prompt, *engine_first, *context], 12)
    assert episode.completion_ids == [*engine_first, *context, *engine_second]
    assert episode.loss_mask == [True] * len(engine_first) + [False] * len(context) + [True] * len(engine_second)
    assert engine_first == choice.lorarl["token_ids"] and engine_second == second.choices[0].lorarl["token_ids"]
    assert renderer.decode(engine_second) == second.choices[0].message.content


async def _turns(server: OpenAIServer, session: str) -> list[dict]:
    return [t.as_json() for t in server.endpoint.sessions.turns(session)]


def _greedy(harness: RolloutHarness, prompt: list[int], max_tokens: int) -> list[int]:
    response = harness.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=prompt)],
        sampling=common_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)))
    return list(response.results[0].completions[0].token_ids)
