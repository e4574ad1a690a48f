"""The rollout service on the transformers engine (no vLLM needed): text prompts, streaming, top logprobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.rollout.config import RolloutSettings
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import RolloutHarness, generate, greedy, load_requests, reference_greedy
from tests.unit.rollout.models import LORA, PROMPT, dense_model_dir, random_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service() -> Iterator[RolloutHarness]:
    settings = RolloutSettings(model_path=str(dense_model_dir()), engine="hf", dtype="float32", max_model_len=256)
    harness = RolloutHarness(settings).start()
    yield harness
    harness.close()


def test_chat_text_prompt_streams_with_top_logprobs(service: RolloutHarness) -> None:
    stream = service.stub.GenerateStream(rollout_pb2.GenerateStreamRequest(
        prompt=rollout_pb2.Prompt(text="12+34=", apply_chat_template=True), sampling=greedy(6, logprobs=3, n=2)))
    messages = list(stream)
    for index in (0, 1):
        mine = [m for m in messages if m.index == index]
        tokens = [t for m in mine for t in m.token_ids]
        assert tokens == reference_greedy(dense_model_dir(), PROMPT, 6)[0]
        tops = [t for m in mine for t in m.top_logprobs]
        assert len(tops) == 6
        assert all(len(t.token_ids) == 3 and t.token_ids[0] == tok for t, tok in zip(tops, tokens, strict=True))
        assert mine[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_adapter_served_by_the_transformers_engine_matches_peft(service: RolloutHarness) -> None:
    model_dir = dense_model_dir()
    adapter = random_adapter(model_dir, seed=4)
    service.stub.LoadWeights(load_requests("hf", 1, adapter, common_pb2.SYNC_MODE_ADAPTER,
                                           base_model_fingerprint(model_dir), LORA))
    out = generate(service.stub, PROMPT, greedy(12), "hf")
    assert list(out.token_ids) == reference_greedy(model_dir, PROMPT, 12, adapter, LORA)[0]
    assert list(out.token_versions) == [1] * 12
    caps = service.stub.GetCapabilities(rollout_pb2.GetCapabilitiesRequest())
    assert caps.engine == "hf" and caps.supports_lora
