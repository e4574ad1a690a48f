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


def test_the_loop_warns_when_the_rollout_serves_another_dtype(service: RolloutHarness, capsys) -> None:
    """GetCapabilities names the served dtype; lorarl train's preflight warns on a job in another one."""
    import asyncio
    from types import SimpleNamespace

    from lorarl.client.calls import NamedStub
    from lorarl.client.rl.preflight import rollout_warnings
    from lorarl.common.channel import aio_channel
    from lorarl.v1 import rollout_pb2_grpc
    from tests.integration.rollout.harness import TOKEN

    assert service.stub.GetCapabilities(rollout_pb2.GetCapabilitiesRequest()).dtype == "float32"

    async def warnings(dtype: str) -> list[str]:
        async with aio_channel(service.running.address, token=TOKEN) as channel:
            replica = NamedStub(rollout_pb2_grpc.RolloutServiceStub(channel), "rollout", service.running.address)
            return await rollout_warnings(SimpleNamespace(model=SimpleNamespace(dtype=dtype)), [replica])

    assert asyncio.run(warnings("float32")) == []
    (line,) = asyncio.run(warnings("bfloat16"))
    assert f"the rollout at {service.running.address} serves float32" in line
    assert "model.dtype" in line and "rollout.dtype=bfloat16" in line
    assert "lorarl: warning: " in capsys.readouterr().err
