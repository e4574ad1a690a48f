"""16-token KV blocks on CPU (rollout.block_size=16, allowed by lorarl/rollout/vllm/plugin.py).

vLLM's CPU attention backend declares 32-token multiples; the plugin, loaded by vLLM in its engine
process, lets the demo use 16 so a GRPO group's samples share their short prompt's first block. Each
sample must still get exactly what transformers(+PEFT) computes, though 7 of a group's 8 prefills now
read KV that another request of the same engine step wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from lorarl.rollout.config import RolloutSettings
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import RolloutHarness, greedy, load_requests, reference_greedy
from tests.unit.rollout.models import LORA, PROMPT, dense_model_dir, random_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

N = 8
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return dense_model_dir()


@pytest.fixture(scope="module")
def service(model_dir: Path) -> Iterator[RolloutHarness]:
    settings = RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="float32", max_model_len=256,
                               kv_cache_gib=0.25, max_num_seqs=64, block_size=16, max_loras=2)
    harness = RolloutHarness(settings).start()
    yield harness
    harness.close()


def test_the_plugin_is_what_vllm_loads_and_the_engine_runs_16_token_blocks(service: RolloutHarness) -> None:
    assert "lorarl.rollout.vllm.plugin:register" in {e.value for e in entry_points(group="vllm.general_plugins")}
    assert service.core.engine.llm.vllm_config.cache_config.block_size == 16


def test_group_samples_sharing_a_prompt_block_match_transformers(service: RolloutHarness, model_dir: Path) -> None:
    """Prompts of 14 (no full block), 18 and 40 tokens (one and two shared blocks), n=8 greedy samples
    each in one request, with an adapter: every sample equals the transformers+PEFT reference."""
    adapter = random_adapter(model_dir, seed=5)
    fingerprint = service.core.fingerprint
    service.stub.LoadWeights(load_requests("blocks", 1, adapter, common_pb2.SYNC_MODE_ADAPTER, fingerprint, LORA),
                             timeout=120)
    prompts = [PROMPT[:14], (PROMPT * 2)[:18], (PROMPT * 4)[:40]]
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts], sampling=greedy(NEW_TOKENS, n=N),
        policy=rollout_pb2.PolicySelector(job_id="blocks"))
    try:
        for _ in range(2):  # the second time every shared block is already cached
            response = service.stub.Generate(request, timeout=120)
            for prompt, result in zip(prompts, response.results, strict=True):
                tokens, logprobs = reference_greedy(model_dir, prompt, NEW_TOKENS, adapter, LORA)
                assert len(result.completions) == N
                for completion in result.completions:
                    assert list(completion.token_ids) == tokens
                    torch.testing.assert_close(torch.tensor(list(completion.logprobs)), torch.tensor(logprobs),
                                               atol=2e-4, rtol=0)
    finally:
        service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="blocks"))
