"""A tensor-parallel rollout on vLLM CPU: a TP-2 engine (two worker processes, one CPU each) against a TP-1
engine on the same prompts, at temperature 0, token for token.

Adapter mode and merged weights into the LoRA-enabled engine, each delivered both ways: through this
service (LoadWeights) and received by the engine's two workers themselves, each joining the gloo group
with a rank of its own and receiving the full tensors (rollout.receive_in_worker). The thread binding
vLLM CPU needs for two workers is set by the rollout from the CPUs it may use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorarl.common.cpu_affinity import available_cpus
from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.sync import replica_capabilities
from lorarl.rollout.vllm.cpu_binding import BIND_ENV
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import (
    RolloutHarness,
    generate,
    greedy,
    load_requests,
    merged_weights,
    send_in_worker,
)
from tests.unit.rollout.models import LORA, PROMPT, dense_model_dir, random_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(len(available_cpus()) < 2, reason="two vLLM CPU workers need two CPUs")]

ADAPTER = common_pb2.SYNC_MODE_ADAPTER
MERGED = common_pb2.SYNC_MODE_MERGED
N_TOKENS = 16
PROMPTS = (PROMPT, (5, 17, 2, 40, 9, 31), (77, 3, 3, 12))
Served = dict[str, list[tuple[list[int], list[float]]]]


def settings(model_dir: Path, tp: int) -> RolloutSettings:
    return RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="float32", max_model_len=256,
                           kv_cache_gib=0.25, max_loras=4, tensor_parallel_size=tp, enable_lora=True)


def serve_all(service: RolloutHarness, job: str = "") -> list[tuple[list[int], list[float]]]:
    outs = [generate(service.stub, prompt, greedy(N_TOKENS), job) for prompt in PROMPTS]
    return [(list(o.token_ids), list(o.logprobs)) for o in outs]


def load(service: RolloutHarness, job: str, tensors: dict, mode: int, fingerprint: str) -> None:
    service.stub.LoadWeights(load_requests(job, 1, tensors, mode, fingerprint, LORA if mode == ADAPTER else None),
                             timeout=120)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return dense_model_dir()


@pytest.fixture(scope="module")
def fingerprint(model_dir: Path) -> str:
    return base_model_fingerprint(model_dir)


@pytest.fixture(scope="module")
def weights(model_dir: Path) -> dict[str, dict]:
    adapter = random_adapter(model_dir, seed=3)
    return {"adapter": adapter, "merged": merged_weights(model_dir, adapter, LORA)}


@pytest.fixture(scope="module")
def tp1(model_dir: Path, weights: dict[str, dict], fingerprint: str) -> Served:
    """What a one-worker engine serves: the base, the adapter and the merged weights."""
    service = RolloutHarness(settings(model_dir, 1)).start()
    try:
        load(service, "a", weights["adapter"], ADAPTER, fingerprint)
        served = {"base": serve_all(service), "adapter": serve_all(service, "a")}
        load(service, "m", weights["merged"], MERGED, fingerprint)
        served["merged"] = serve_all(service, "m")
    finally:
        service.close()
    return served


@pytest.fixture(scope="module")
def tp2(model_dir: Path, tp1: Served) -> Iterator[RolloutHarness]:
    before = os.environ.pop(BIND_ENV, None)
    try:
        service = RolloutHarness(settings(model_dir, 2)).start()
        binding = os.environ.get(BIND_ENV)
    finally:
        os.environ.pop(BIND_ENV, None)
        if before is not None:
            os.environ[BIND_ENV] = before
    service.binding = binding  # type: ignore[attr-defined]
    yield service
    service.close()


def same_as(served: list[tuple[list[int], list[float]]], reference: list[tuple[list[int], list[float]]]) -> None:
    """Token for token; logprobs to the last few bits (the two workers' all-reduce sums in another order)."""
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(served, reference, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=0)


def test_two_workers_bound_to_a_cpu_each(tp2: RolloutHarness) -> None:
    cpus = available_cpus()
    half = len(cpus) // 2
    assert tp2.binding is not None and tp2.binding.count("|") == 1  # type: ignore[attr-defined]
    assert len(set(tp2.binding.replace("|", ",").split(","))) >= 2  # type: ignore[attr-defined]
    assert tp2.core.engine.worker_count == 2 and half >= 1
    tp2.core.engine.receives_in_worker = True
    try:
        assert replica_capabilities(tp2.core, ["gloo"]).receiving_ranks == 2
    finally:
        tp2.core.engine.receives_in_worker = False
    assert replica_capabilities(tp2.core, ["gloo"]).receiving_ranks == 1


def test_base_adapter_and_merged_equal_one_worker(tp2: RolloutHarness, tp1: Served, weights, fingerprint) -> None:
    same_as(serve_all(tp2), tp1["base"])
    load(tp2, "a", weights["adapter"], ADAPTER, fingerprint)
    same_as(serve_all(tp2, "a"), tp1["adapter"])
    load(tp2, "m", weights["merged"], MERGED, fingerprint)  # merged weights into the LoRA-enabled engine
    same_as(serve_all(tp2, "m"), tp1["merged"])
    for job in ("a", "m"):
        tp2.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=job))
    same_as(serve_all(tp2), tp1["base"])


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_each_worker_receives_with_its_own_rank(tp2: RolloutHarness, tp1: Served, weights, fingerprint,
                                                mode: str) -> None:
    """Ranks 1 and 2 of a world of 3 (the sender is 0): both workers join, each verifies the full version
    and loads its shard; what the engine then serves equals the one-worker engine."""
    wire = ADAPTER if mode == "adapter" else MERGED
    engine = tp2.core.engine
    engine.receives_in_worker = True
    try:
        send_in_worker(tp2, f"wrk-{mode}", weights[mode], wire, wire, fingerprint, ranks=(1, 2))
    finally:
        engine.receives_in_worker = False
    served = serve_all(tp2, f"wrk-{mode}")
    same_as(served, tp1[mode])
    tp2.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=f"wrk-{mode}"))


def test_a_receive_with_one_rank_for_two_workers_is_refused(tp2: RolloutHarness, weights, fingerprint) -> None:
    engine = tp2.core.engine
    engine.receives_in_worker = True
    try:
        with pytest.raises(ValueError, match="1 transfer ranks for an engine of 2 workers"):
            tp2.call(engine.receive_in_worker("t", b"", {"ranks": [1]}, None))
    finally:
        engine.receives_in_worker = False
