"""Request validation: each nonsense field is INVALID_ARGUMENT naming that field; zero values resolve."""

from __future__ import annotations

import pytest

from lorarl.common.errors import InvalidArgumentError
from lorarl.rollout.prompts import PromptRenderer
from lorarl.rollout.validation import Limits, generate_input, stream_input
from lorarl.v1 import common_pb2, rollout_pb2
from tests.unit.rollout.models import PROMPT, dense_model_dir

LIMITS = Limits(vocab_size=264, max_model_len=64, max_n=8, max_logprobs=5, default_max_tokens=32)


def request(prompts: list[rollout_pb2.Prompt] | None = None, **sampling: object) -> rollout_pb2.GenerateRequest:
    prompts = [rollout_pb2.Prompt(token_ids=[1, 2, 3])] if prompts is None else prompts
    return rollout_pb2.GenerateRequest(prompts=prompts, sampling=common_pb2.SamplingParams(**sampling))


def test_zero_values_resolve_to_defaults() -> None:
    parsed = generate_input(request(), LIMITS, None)
    s = parsed.sampling
    assert (s.n, s.top_p, s.top_k, s.max_tokens, s.seed, s.temperature) == (1, 1.0, -1, 32, None, 0.0)
    assert parsed.request_id and parsed.prompts == ((1, 2, 3),)
    assert generate_input(request([rollout_pb2.Prompt(token_ids=list(range(60)))]), LIMITS, None).sampling.max_tokens \
        == 4  # default capped by the context left


@pytest.mark.parametrize(("req", "field"), [
    (request([]), "prompts"),
    (request([rollout_pb2.Prompt()]), "prompts[0]"),
    (request([rollout_pb2.Prompt(token_ids=[1]), rollout_pb2.Prompt(token_ids=[5, 264])]), "prompts[1].token_ids[1]"),
    (request([rollout_pb2.Prompt(token_ids=list(range(64)))]), "prompts[0]"),
    (request(n=9), "sampling.n"),
    (request(temperature=-1.0), "sampling.temperature"),
    (request(temperature=float("nan")), "sampling.temperature"),
    (request(top_p=1.5), "sampling.top_p"),
    (request(top_k=-2), "sampling.top_k"),
    (request(max_tokens=62), "sampling.max_tokens"),
    (request(stop=["ok", ""]), "sampling.stop"),
    (request(stop_token_ids=[999]), "sampling.stop_token_ids[0]"),
    (request(logprobs=6), "sampling.logprobs"),
    (request(seed=2**63), "sampling.seed"),
])
def test_nonsense_is_refused_naming_the_field(req: rollout_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        generate_input(req, LIMITS, None)
    assert info.value.field == field


@pytest.mark.parametrize(("at", "past", "field"), [
    (dict(n=8), dict(n=9), "sampling.n"),
    (dict(temperature=2.0), dict(temperature=2.01), "sampling.temperature"),
    (dict(temperature=0.0), dict(temperature=-0.01), "sampling.temperature"),
    (dict(top_p=1.0), dict(top_p=1.01), "sampling.top_p"),
    (dict(top_k=264), dict(top_k=265), "sampling.top_k"),
    (dict(top_k=-1), dict(top_k=-2), "sampling.top_k"),
    (dict(max_tokens=61), dict(max_tokens=62), "sampling.max_tokens"),
    (dict(stop=["s"] * 32), dict(stop=["s"] * 33), "sampling.stop"),
    (dict(stop_token_ids=[263]), dict(stop_token_ids=[264]), "sampling.stop_token_ids[0]"),
    (dict(logprobs=5), dict(logprobs=6), "sampling.logprobs"),
    (dict(seed=2**63 - 1), dict(seed=2**63), "sampling.seed"),
])
def test_each_bound_is_served_at_and_refused_past(at: dict, past: dict, field: str) -> None:
    """#29: the rollout's Generate bounds, one row each: the bound itself is served, one past it is refused
    naming the field (a 3-token prompt; max_model_len 64, vocabulary 264, n 8, 5 logprobs)."""
    generate_input(request(**at), LIMITS, None)
    with pytest.raises(InvalidArgumentError) as info:
        generate_input(request(**past), LIMITS, None)
    assert info.value.field == field


def test_the_longest_prompt_is_served_and_one_more_token_refused() -> None:
    generate_input(request([rollout_pb2.Prompt(token_ids=[1] * 63)]), LIMITS, None)
    with pytest.raises(InvalidArgumentError) as info:
        generate_input(request([rollout_pb2.Prompt(token_ids=[1] * 64)]), LIMITS, None)
    assert info.value.field == "prompts[0]"
    generate_input(request([rollout_pb2.Prompt(token_ids=[263])]), LIMITS, None)


def test_text_prompts_use_the_model_tokenizer_and_chat_template() -> None:
    renderer = PromptRenderer(dense_model_dir())
    chat = rollout_pb2.GenerateStreamRequest(prompt=rollout_pb2.Prompt(text="12+34=", apply_chat_template=True))
    assert stream_input(chat, LIMITS, renderer).prompts == (PROMPT,)
    raw = rollout_pb2.GenerateStreamRequest(prompt=rollout_pb2.Prompt(text="hi"))
    assert stream_input(raw, LIMITS, renderer).prompts == ((104, 105),)
    messages = '[{"role": "user", "content": "12+34="}]'
    listed = rollout_pb2.GenerateStreamRequest(prompt=rollout_pb2.Prompt(text=messages, apply_chat_template=True))
    assert stream_input(listed, LIMITS, renderer).prompts == (PROMPT,)
    with pytest.raises(InvalidArgumentError, match="no tokenizer") as info:
        stream_input(raw, LIMITS, None)
    assert info.value.field == "prompt.text"
