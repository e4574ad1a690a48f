"""The rollout's OpenAI-compatible endpoint on real vLLM, driven by the official `openai` client: chat and
text completions (n, temperature, max_tokens, logprobs, streaming), the policy chosen by `model`, tools in
the chat template, errors as the client raises them, and sessions that keep every turn's exact tokens so an
episode's trajectory is what the engine generated, turn after turn."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from lorarl.client.workflow.sessions import session_episodes
from lorarl.contract.chat import ChatRenderer
from lorarl.contract.tool_calls import parse_tool_calls
from lorarl.rollout.openai.http_server import OpenAIServer
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import TOKEN, RolloutHarness, openai_served
from tests.unit.rollout.models import dense_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
QUESTION = [{"role": "user", "content": "12+34="}]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluates arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expr": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[RolloutHarness, OpenAIServer]]:
    with openai_served(dense_model_dir()) as served:
        yield served


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    _, server = served
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=TOKEN, max_retries=0)


def engine_greedy(harness: RolloutHarness, prompt: list[int], max_tokens: int) -> rollout_pb2.Completion:
    """What the engine generates for these token ids over gRPC: the reference the endpoint must equal."""
    response = harness.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=prompt)],
        sampling=common_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)))
    return response.results[0].completions[0]


def session(served, session_id: str) -> list[dict]:
    _, server = served
    reply = httpx.get(f"http://127.0.0.1:{server.port}/v1/sessions/{session_id}",
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["turns"]


def test_models_name_the_base(client: openai.OpenAI) -> None:
    assert "qwen3-tiny" in [m.id for m in client.models.list().data]


def test_an_idle_connection_outlives_the_clients_own_idle_expiry(served) -> None:
    """httpx (and so `openai`) keeps an idle connection for 5 s; the server keeps it longer, so a request the client
    sends on a connection it still holds is never met by the server closing it (ReadError)."""
    import http.client
    import time

    _, server = served
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        sockets = []
        for idle_s in (0.0, httpx.Limits().keepalive_expiry + 1):  # then idle past the client's own expiry
            time.sleep(idle_s)
            conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
            reply = conn.getresponse()  # a closed connection: RemoteDisconnected
            assert reply.status == 200 and b"qwen3-tiny" in reply.read()
            sockets.append(conn.sock)
        assert sockets[0] is sockets[1]  # one connection, still open
    finally:
        conn.close()


def test_a_chat_completion_is_what_the_engine_generates_and_the_session_keeps_it(served, client) -> None:
    harness, _ = served
    reply = client.chat.completions.create(model="qwen3-tiny", messages=QUESTION, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2, user="ep-1")
    (choice,) = reply.choices
    prompt = ChatRenderer(str(dense_model_dir())).render(QUESTION)
    want = engine_greedy(harness, prompt, 8)
    assert choice.lorarl["token_ids"] == list(want.token_ids)
    assert choice.message.content == ChatRenderer(str(dense_model_dir())).decode(list(want.token_ids))
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(list(want.logprobs), abs=1e-5)
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(want.token_ids)
    (turn,) = session(served, "ep-1")
    assert turn["prompt_token_ids"] == prompt and turn["token_ids"] == list(want.token_ids)
    assert turn["logprobs"] == pytest.approx(list(want.logprobs), abs=1e-5) and set(turn["versions"]) == {0}


def test_a_multi_turn_session_is_one_token_sequence_with_the_environment_masked(served, client) -> None:
    """Turn 2 continues turn 1's exact tokens (not a re-rendering of its text); the tool's answer is context."""
    first = client.chat.completions.create(model="qwen3-tiny", messages=QUESTION, tools=TOOLS, max_tokens=6,
                                           temperature=0, extra_headers={"X-Session-Id": "ep-2"})
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    follow = [*QUESTION, assistant, {"role": "user", "content": "Check it."}]
    second = client.chat.completions.create(model="qwen3-tiny", messages=follow, tools=TOOLS, max_tokens=5,
                                            temperature=0, extra_headers={"X-Session-Id": "ep-2"})
    turns = session(served, "ep-2")
    assert len(turns) == 2
    one, two = turns
    start = one["prompt_token_ids"] + one["token_ids"]
    assert two["prompt_token_ids"][: len(start)] == start
    assert two["token_ids"] == second.choices[0].lorarl["token_ids"]
    renderer = ChatRenderer(str(dense_model_dir()))
    assert "<tools>\n{\"name\": \"calc\"" in renderer.decode(one["prompt_token_ids"])  # tools went through the template
    (episode,) = session_episodes(turns)
    assert episode.prompt_ids == one["prompt_token_ids"]
    assert episode.completion_ids == two["prompt_token_ids"][len(one["prompt_token_ids"]):] + two["token_ids"]
    context = len(two["prompt_token_ids"]) - len(start)
    assert episode.loss_mask == [True] * len(one["token_ids"]) + [False] * context + [True] * len(two["token_ids"])
    # an agent that edits its earlier turn gets the conversation rendered from text: a new trajectory
    edited = [*QUESTION, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "Again."}]
    client.chat.completions.create(model="qwen3-tiny", messages=edited, max_tokens=3, temperature=0,
                                   extra_headers={"X-Session-Id": "ep-2"})
    assert len(session_episodes(session(served, "ep-2"))) == 2


def test_streaming_gives_the_same_text_and_tokens(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="qwen3-tiny", messages=QUESTION, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="qwen3-tiny", messages=QUESTION, max_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices[0].lorarl["token_ids"] == whole.choices[0].lorarl["token_ids"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_text_completions_n_and_seed(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model="base", prompt="12+34=", max_tokens=6, temperature=0, logprobs=1)
    assert len(greedy.choices[0].logprobs.token_logprobs) == len(greedy.choices[0].lorarl["token_ids"])
    sampled = [client.completions.create(model="base", prompt="12+34=", max_tokens=6, temperature=1.0, n=3,
                                         seed=7) for _ in range(2)]
    assert len(sampled[0].choices) == 3
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]  # seeded: reproducible


def test_bad_requests_are_refused_as_the_client_expects(served, client) -> None:
    _, server = served
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    with pytest.raises(openai.BadRequestError, match=r"sampling\.temperature"):
        client.chat.completions.create(model="base", messages=QUESTION, temperature=99)
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        client.chat.completions.create(model="base", messages=[])
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="base", messages=QUESTION, tools=TOOLS, tool_choice="required")
    with pytest.raises(openai.NotFoundError, match="no policy of job 'nojob'"):
        client.chat.completions.create(model="nojob", messages=QUESTION, max_tokens=2)
    reply = httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", content=b"{not json",
                       headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 400 and "not JSON" in reply.json()["error"]["message"]
    assert httpx.get(f"http://127.0.0.1:{server.port}/v1/sessions/none",
                     headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404


def test_tool_calls_in_qwen3_format_become_openai_tool_calls() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "12+34"}}\n</tool_call>'
    content, (call,) = parse_tool_calls(text)
    assert content == "Let me compute." and call["function"] == {"name": "calc", "arguments": '{"expr": "12+34"}'}
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])


def test_concurrent_sessions_stay_apart(served, client) -> None:
    async def one(i: int) -> None:
        async_client = openai.AsyncOpenAI(base_url=client.base_url, api_key=TOKEN, max_retries=0)
        await async_client.chat.completions.create(model="base", messages=QUESTION, max_tokens=3, temperature=0,
                                                   user=f"par-{i}")

    async def all_of() -> None:
        await asyncio.gather(*(one(i) for i in range(6)))

    asyncio.run(all_of())
    assert all(len(session(served, f"par-{i}")) == 1 for i in range(6))


@pytest.fixture(scope="module", autouse=True)
def _model_dir_exists() -> Path:
    return dense_model_dir()


def test_fields_are_refused_or_served_as_openai_clients_expect(served, client, caplog) -> None:
    """#29: what the request schemas (lorarl/rollout/openai/requests.py) refuse, by name, with a log line;
    neutral values of fields the endpoint does not serve still pass."""
    import logging

    harness, server = served
    bad = [
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(presence_penalty=0.5), "presence_penalty is not served"),
        (dict(logit_bias={"5": 1.0}), "logit_bias is not served"),
        (dict(response_format={"type": "json_object"}), "response_format is not served"),
        (dict(tools=[{"type": "function", "function": {"name": 7}}]), r"tools\[0\]\.function\.name"),
        (dict(extra_body={"frobnicate": 1}), "Unrecognized request argument supplied: frobnicate"),
    ]
    with caplog.at_level(logging.INFO, logger="lorarl.rollout.openai.app"):
        for kwargs, message in bad:
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(model="base", messages=QUESTION, **kwargs)
        with pytest.raises(openai.BadRequestError, match="best_of=2 is not served"):
            client.completions.create(model="base", prompt="12+34=", best_of=2, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="max_tokens: 0 generates nothing"):
            client.completions.create(model="base", prompt="12+34=", max_tokens=0)
        with pytest.raises(openai.BadRequestError, match="echo with stream is not served"):
            client.completions.create(model="base", prompt="12+34=", echo=True, max_tokens=2, stream=True)
    assert sum("refused POST /v1/chat/completions: 400" in r.getMessage() for r in caplog.records) == len(bad)
    reply = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", json={"model": "base", "prompt": "1",
                       "max_tokens": "3"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"  # no "3" for 3
    neutral = client.chat.completions.create(model="base", messages=QUESTION, max_tokens=2, presence_penalty=0,
                                             frequency_penalty=0, logit_bias={}, response_format={"type": "text"})
    assert neutral.choices[0].finish_reason == "length"
    by_path = client.completions.create(model=str(harness.core.info.model_path), prompt="12+34=", max_tokens=2)
    assert len(by_path.choices[0].lorarl["token_ids"]) == 2  # type: ignore[attr-defined]


def test_stop_strings_are_cut_and_prompt_lists_are_served(client) -> None:
    """The stop string is not in the returned text (it is in the token ids the trainer sees), streamed or
    not; a list of prompts, as strings or token ids, gives n choices per prompt in OpenAI's order."""
    free = client.completions.create(model="base", prompt="12+34=", max_tokens=12, temperature=0)
    text = free.choices[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    expected = text[:text.find(stop)]
    stopped = client.completions.create(model="base", prompt="12+34=", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    assert stop in ChatRenderer(str(dense_model_dir())).decode(stopped.choices[0].lorarl["token_ids"])  # type: ignore[attr-defined]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="base", prompt="12+34=", max_tokens=12, temperature=0, stop=stop, stream=True))
    assert streamed == expected
    many = client.completions.create(model="base", prompt=["12+34=", "7*6="], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == free.choices[0].text[:len(many.choices[0].text)]
    ids = ChatRenderer(str(dense_model_dir())).tokenizer.encode("7*6=", add_special_tokens=True)
    as_ids = client.completions.create(model="base", prompt=[ids, ids], max_tokens=4, temperature=0)
    assert [c.text for c in as_ids.choices] == [many.choices[2].text] * 2


def test_echo_returns_the_prompts_logprobs_as_the_engine_computes_them(served, client) -> None:
    """echo (lm-eval's log-likelihood requests: echo, max_tokens 0 or 1, logprobs 1): the prompt's text and each
    of its tokens' logprobs, as the engine computes them over gRPC, with the top alternative at each position;
    the first token's is null as OpenAI's is."""
    harness, _ = served
    text = "12+34=46"
    ids = ChatRenderer(str(dense_model_dir())).tokenizer.encode(text, add_special_tokens=True)
    want = harness.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=ids)],
        sampling=common_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=1, prompt_logprobs=True)))
    (result,) = want.results
    assert len(result.prompt_top_logprobs) == len(ids) and not result.prompt_top_logprobs[0].token_ids
    assert all(len(top.token_ids) == 1 for top in result.prompt_top_logprobs[1:])

    alone = client.completions.create(model="base", prompt=text, echo=True, max_tokens=0, logprobs=1, temperature=0)
    (choice,) = alone.choices
    lp = choice.logprobs
    assert choice.text == text and "".join(lp.tokens) == text and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(list(result.prompt_logprobs)[1:], abs=1e-5)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    for own, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 1 and max(top.values()) >= own - 1e-6  # the greedy token is at least as likely
    assert alone.usage.completion_tokens == 0 and choice.lorarl["token_ids"] == []  # type: ignore[attr-defined]

    more = client.completions.create(model="base", prompt=[ids], echo=True, max_tokens=2, logprobs=1, temperature=0)
    (choice,) = more.choices
    generated = engine_greedy(harness, ids, 2)
    assert choice.text == text + ChatRenderer(str(dense_model_dir())).decode(list(generated.token_ids))
    assert choice.logprobs.token_logprobs[len(ids):] == pytest.approx(list(generated.logprobs), abs=1e-5)
    assert choice.logprobs.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    plain = client.completions.create(model="base", prompt=text, echo=True, max_tokens=2, temperature=0)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


# ------------------------------------------------------------------ a scored session (on-policy distillation)

TEACHER = "expert"


@pytest.fixture(scope="module")
def teacher(served) -> str:
    """A random adapter served as job ``expert``: the teacher that scores a distilled agent's turns."""
    from lorarl.contract.fingerprint import base_model_fingerprint
    from tests.integration.rollout.harness import load_requests
    from tests.unit.rollout.models import LORA, random_adapter

    harness, _ = served
    harness.stub.LoadWeights(load_requests(TEACHER, 1, random_adapter(dense_model_dir(), seed=5),
                                           common_pb2.SYNC_MODE_ADAPTER, base_model_fingerprint(dense_model_dir()),
                                           LORA))
    return TEACHER


def teacher_header(*entries: dict) -> dict[str, str]:
    import json

    from lorarl.contract.agent_sessions import TEACHERS_HEADER

    return {TEACHERS_HEADER: json.dumps(list(entries))}


def read_logprobs(harness: RolloutHarness, prompt: list[int], tokens: list[int], job_id: str) -> list[float]:
    """``job_id``'s logprobs of ``tokens`` after ``prompt`` (the base's with ""), read over gRPC: the reference."""
    response = harness.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=[*prompt, *tokens])], policy=rollout_pb2.PolicySelector(job_id=job_id),
        sampling=common_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=True)))
    return list(response.results[0].prompt_logprobs)[len(prompt):]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_scored_sessions_turns_carry_their_teachers_logprobs_into_the_trajectory(served, client, teacher,
                                                                                   stream: bool) -> None:
    """An agent's two turns (the student is the base here) with X-Lorarl-Teachers: each turn's record carries the
    teacher's logprob of every sampled token, equal to the teacher adapter's own reading of those tokens (within
    1e-3) and not the student's; the session's trajectory has them on the policy's tokens, 0 on the context."""
    harness, _ = served
    sid = f"scored-{stream}"
    headers = {"X-Session-Id": sid, **teacher_header({"job_id": teacher, "weight": 1.0})}

    def turn(messages: list[dict]) -> dict:
        if not stream:
            reply = client.chat.completions.create(model="base", messages=messages, max_tokens=6, temperature=1.0,
                                                   seed=3, extra_headers=headers)
            return reply.choices[0].message.model_dump(exclude_none=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="base", messages=messages, max_tokens=6, temperature=1.0, seed=3, stream=True,
            extra_headers=headers) if chunk.choices)
        return {"role": "assistant", "content": text}

    first = turn(QUESTION)
    turn([*QUESTION, first, {"role": "user", "content": "Check it."}])
    turns = session(served, sid)
    assert len(turns) == 2
    for record in turns:
        want = read_logprobs(harness, record["prompt_token_ids"], record["token_ids"], teacher)
        assert record["teacher_logprobs"] == pytest.approx(want, abs=1e-3)
        assert record["teacher_seconds"] > 0
        student = read_logprobs(harness, record["prompt_token_ids"], record["token_ids"], "")
        assert max(abs(a - b) for a, b in zip(record["teacher_logprobs"], student, strict=True)) > 0.05
    (episode,) = session_episodes(turns)
    assert episode.teacher_logprobs is not None and len(episode.teacher_logprobs) == len(episode.completion_ids)
    trained = [lp for lp, m in zip(episode.teacher_logprobs, episode.loss_mask, strict=True) if m]
    assert trained == turns[0]["teacher_logprobs"] + turns[1]["teacher_logprobs"]
    assert all(lp == 0.0 for lp, m in zip(episode.teacher_logprobs, episode.loss_mask, strict=True) if not m)
    proto = episode.to_proto("student", "t", "g")
    assert list(proto.teacher_logprobs) == pytest.approx(episode.teacher_logprobs)


def test_a_scored_turn_without_a_session_or_with_a_bad_teacher_is_refused_by_its_header(served, client,
                                                                                        teacher) -> None:
    """Refused before sampling, 400 (404 for a teacher the replica does not serve) naming X-Lorarl-Teachers, and
    nothing recorded in the session."""
    cases = [
        ({}, teacher_header({"job_id": teacher, "weight": 1.0}), 400, "send X-Session-Id"),
        ({"X-Session-Id": "bad"}, {"X-Lorarl-Teachers": "[{"}, 400, "is not JSON"),
        ({"X-Session-Id": "bad"}, teacher_header({"job_id": teacher, "weight": -1.0}), 400, "weight"),
        ({"X-Session-Id": "bad"}, teacher_header({"job_id": teacher, "weight": 1, "rank": 8}), 400, "rank"),
        ({"X-Session-Id": "bad"}, teacher_header({"job_id": teacher, "weight": 0.0}), 400, "are all 0"),
        ({"X-Session-Id": "bad"}, teacher_header({"engine": "add", "weight": 1.0}), 400, "no teacher engine 'add'"),
        ({"X-Session-Id": "bad"}, teacher_header({"job_id": "nobody", "weight": 1.0}), 404, "no teacher 'nobody'"),
    ]
    for session_headers, header, status, words in cases:
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="base", messages=QUESTION, max_tokens=2,
                                           extra_headers={**session_headers, **header})
        assert refused.value.status_code == status, (header, refused.value.message)
        assert words in refused.value.message and "X-Lorarl-Teachers" in refused.value.message, refused.value.message
    _, server = served
    gone = httpx.get(f"http://127.0.0.1:{server.port}/v1/sessions/bad", headers={"Authorization": f"Bearer {TOKEN}"})
    assert gone.status_code == 404


def test_a_turn_its_teachers_cannot_score_is_not_recorded_and_says_why(served, client, teacher) -> None:
    """A teacher version the replica does not hold is found when the turn is scored, after sampling: a whole turn is
    refused (404), a streamed one (its 200 already sent) ends with OpenAI's error event; neither is recorded."""
    headers = {"X-Session-Id": "unscored", **teacher_header({"job_id": teacher, "version": 9, "weight": 1.0})}
    with pytest.raises(openai.NotFoundError, match=r"version 9|v9"):
        client.chat.completions.create(model="base", messages=QUESTION, max_tokens=3, extra_headers=headers)
    with pytest.raises(openai.APIError, match="could not score it") as ended:
        for _ in client.chat.completions.create(model="base", messages=QUESTION, max_tokens=3, stream=True,
                                                extra_headers=headers):
            pass
    assert "X-Lorarl-Teachers" in str(ended.value)
    _, server = served
    gone = httpx.get(f"http://127.0.0.1:{server.port}/v1/sessions/unscored",
                     headers={"Authorization": f"Bearer {TOKEN}"})
    assert gone.status_code == 404
