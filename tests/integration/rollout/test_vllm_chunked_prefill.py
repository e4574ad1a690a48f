"""Seeded sampling while vLLM chunks prefills, on CPU: the engine must survive and stay deterministic.

vLLM rewinds a seeded request's generator offset when it discards the token sampled for a partial
prefill, which CPU generators cannot do ("CPU Generator does not use offset") — without the
workaround in lorarl/rollout/vllm/worker_ext.py the first such step kills the engine. A small
``max_num_batched_tokens`` makes every batch of these prompts chunk. The workaround restores those
generators' state instead of rewinding an offset, so the tokens do not depend on the chunking, which
depends on what else the engine runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lorarl.rollout.config import RolloutSettings
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import RolloutHarness
from tests.unit.rollout.models import dense_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def service() -> Iterator[RolloutHarness]:
    settings = RolloutSettings(model_path=str(dense_model_dir()), engine="vllm", dtype="float32", max_model_len=256,
                               kv_cache_gib=0.25, max_num_seqs=32, max_num_batched_tokens=32, enable_lora=False)
    harness = RolloutHarness(settings).start()
    yield harness
    harness.close()


def test_seeded_groups_with_chunked_prefills(service: RolloutHarness) -> None:
    prompts = [rollout_pb2.Prompt(token_ids=[(7 * p + i) % 200 + 1 for i in range(24 + p)]) for p in range(6)]
    sampling = common_pb2.SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    request = rollout_pb2.GenerateRequest(prompts=prompts, sampling=sampling)
    first = service.stub.Generate(request, timeout=120)
    second = service.stub.Generate(request, timeout=120)
    tokens = [[list(c.token_ids) for c in r.completions] for r in first.results]
    assert all(len(c) == 8 for group in tokens for c in group)
    assert tokens == [[list(c.token_ids) for c in r.completions] for r in second.results]
    assert any(len({tuple(c) for c in group}) > 1 for group in tokens)  # sampled, not greedy copies
    # Alone, a prompt is chunked differently (it has the token budget to itself, and its first blocks are
    # cached now), yet a seeded request samples the same tokens: the discarded partial-prefill samples
    # leave no trace in its generator.
    for p in (0, 5):
        alone = rollout_pb2.GenerateRequest(prompts=[prompts[p]], sampling=sampling)
        completions = service.stub.Generate(alone, timeout=120).results[0].completions
        assert [list(c.token_ids) for c in completions] == tokens[p]
