"""The rollout service on real vLLM with the Qwen3-MoE model: no LoRA on CPU, so merged mode (mode 2).

Merged weights (trainer-style: every checkpoint tensor, experts included) reload between engine
steps and give what transformers computes from the same checkpoint; an adapter is refused with the
reason, or merged locally when weight sync says so; a switch mid-generation retags the tokens. The
replica records routed experts (rollout.record_routes): every completion carries the experts its routers
chose, the ones the trainer's own routers choose on the same tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.model_files import ModelFiles
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import (
    RolloutHarness,
    generate,
    greedy,
    load_requests,
    merged_weights,
    reference_greedy,
    save_checkpoint,
)
from tests.unit.rollout.models import ATTENTION, LORA, PROMPT, moe_model_dir, random_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ADAPTER = common_pb2.SYNC_MODE_ADAPTER
MERGED = common_pb2.SYNC_MODE_MERGED
N_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return moe_model_dir()


@pytest.fixture(scope="module")
def fingerprint(model_dir: Path) -> str:
    return base_model_fingerprint(model_dir)


@pytest.fixture(scope="module")
def service(model_dir: Path) -> Iterator[RolloutHarness]:
    settings = RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="float32", max_model_len=512,
                               kv_cache_gib=0.5, record_routes=True)
    harness = RolloutHarness(settings).start()
    yield harness
    harness.close()


def policy_weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """A trainer-like merged policy: attention adapter merged in, and every expert nudged."""
    files = ModelFiles(model_dir)
    g = torch.Generator().manual_seed(seed)
    experts = {n: t + torch.randn(t.shape, generator=g) * 0.02 for n, t in files.tensors()
               if ".experts." in n}
    return merged_weights(model_dir, random_adapter(model_dir, seed=seed, targets=ATTENTION), LORA, experts)


def load(service: RolloutHarness, job: str, version: int, tensors: dict, fingerprint: str, mode: int = MERGED
         ) -> rollout_pb2.LoadWeightsResponse:
    lora = LORA if mode == ADAPTER else None
    return service.stub.LoadWeights(load_requests(job, version, tensors, mode, fingerprint, lora), timeout=120)


def test_capabilities_say_merged_only_and_adapters_are_refused(service: RolloutHarness, model_dir,
                                                              fingerprint) -> None:
    caps = service.stub.GetCapabilities(rollout_pb2.GetCapabilitiesRequest())
    assert not caps.supports_lora and list(caps.modes) == [MERGED] and caps.max_loras == 0
    assert "merged" in caps.reason and "Moe" in caps.reason
    with pytest.raises(grpc.RpcError) as info:
        load(service, "a", 1, random_adapter(model_dir, targets=ATTENTION), fingerprint, mode=ADAPTER)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and caps.reason in info.value.details()


def test_merged_weights_match_transformers_on_the_same_checkpoint(service: RolloutHarness, model_dir,
                                                                  fingerprint) -> None:
    base = generate(service.stub, PROMPT, greedy(N_TOKENS))
    assert list(base.token_ids) == reference_greedy(model_dir, PROMPT, N_TOKENS)[0]
    for version in (1, 2):  # the second reload exercises the weight-update path again
        weights = policy_weights(model_dir, seed=version)
        load(service, "moe", version, weights, fingerprint)
        out = generate(service.stub, PROMPT, greedy(N_TOKENS, logprobs=0), "moe")
        tokens, logprobs = reference_greedy(save_checkpoint(model_dir, weights), PROMPT, N_TOKENS)
        assert list(out.token_ids) == tokens
        torch.testing.assert_close(torch.tensor(list(out.logprobs)), torch.tensor(logprobs), atol=2e-4, rtol=0)
        assert list(out.token_versions) == [version] * N_TOKENS
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="moe"))
    assert list(generate(service.stub, PROMPT, greedy(N_TOKENS)).token_ids) == list(base.token_ids)


def test_switch_mid_generation_retags_tokens(service: RolloutHarness, model_dir, fingerprint) -> None:
    load(service, "sw", 1, policy_weights(model_dir, seed=5), fingerprint)
    second = policy_weights(model_dir, seed=6)
    total = 300
    stream = service.stub.GenerateStream(rollout_pb2.GenerateStreamRequest(
        prompt=rollout_pb2.Prompt(token_ids=PROMPT), sampling=greedy(total),
        policy=rollout_pb2.PolicySelector(job_id="sw")), timeout=120)
    tokens, versions, switch = [], [], None
    for message in stream:
        tokens += message.token_ids
        versions += message.token_versions
        if switch is None and len(tokens) >= 20:
            switch = threading.Thread(target=load, args=(service, "sw", 2, second, fingerprint))
            switch.start()
    assert switch is not None
    switch.join(60)
    k = versions.index(2)
    assert len(tokens) == total and 20 <= k < total and versions == [1] * k + [2] * (total - k)
    rest = generate(service.stub, PROMPT + tuple(tokens[:k]), greedy(total - k), "sw", 2)
    assert list(rest.token_ids) == tokens[k:]
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="sw"))


def test_adapter_merged_locally_when_weight_sync_says_so(service: RolloutHarness, model_dir, fingerprint) -> None:
    from lorarl.rollout.sink import RolloutSink
    from lorarl.weightsync.client.sinks import PolicyUpdate
    from lorarl.weightsync.wire.payload import build_manifest, pack

    adapter = random_adapter(model_dir, seed=9, targets=ATTENTION)
    manifest = build_manifest(job_id="local", version=1, mode=ADAPTER, base_model_fingerprint=fingerprint,
                              buckets=list(pack(sorted(adapter.items()))), lora=common_pb2.LoraSpec(rank=8, alpha=16))
    sink = RolloutSink(service.core, service.loop)
    sink.stage(PolicyUpdate(manifest, adapter, MERGED))
    sink.commit("local", 1)
    out = generate(service.stub, PROMPT, greedy(N_TOKENS), "local")
    reference = save_checkpoint(model_dir, merged_weights(model_dir, adapter, LORA))
    assert list(out.token_ids) == reference_greedy(reference, PROMPT, N_TOKENS)[0]
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="local"))


def trainer_routes(model_dir: Path, prompt: tuple[int, ...], completions: list) -> list:
    """The experts the trainer's own routers choose on each completion's tokens (transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    from lorarl.trainer.engines.api import TrajectoryRecord
    from lorarl.trainer.engines.torch import routing_replay

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    routing_replay.install(model)
    records = [TrajectoryRecord(list(prompt), list(c.token_ids), [0.0] * len(c.token_ids), [0] * len(c.token_ids),
                                0.0) for c in completions]
    return routing_replay.live_routes(model, records)


def test_completions_carry_the_experts_their_routers_chose(service: RolloutHarness, model_dir) -> None:
    from lorarl.contract.routes import RoutedExperts

    response = service.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT)],
        sampling=common_pb2.SamplingParams(n=3, temperature=1.0, max_tokens=N_TOKENS, seed=4)), timeout=120)
    completions = list(response.results[0].completions)
    recorded = [RoutedExperts.from_proto(c.routed_experts) for c in completions]
    expected = trainer_routes(model_dir, PROMPT, completions)
    agree = total = 0
    for c, got, want in zip(completions, recorded, expected, strict=True):
        assert got is not None and got.recorded_fraction == 1.0
        assert (got.positions, got.layers, got.top_k, got.num_experts) == (len(PROMPT) + len(c.token_ids) - 1, 4, 2, 8)
        same = (np.sort(got.ids, -1) == np.sort(want.ids, -1)).all(-1)
        agree, total = agree + int(same.sum()), total + same.size
    assert agree / total >= 0.99, f"{agree}/{total} (position, layer) routes agree with the trainer's"
    # every finished request's routes were handed over: nothing is left behind in the worker
    assert service.call(service.core.engine.llm.collective_rpc("lorarl_forget_routes", kwargs={"request_ids": []})
                        )[0] == 0


def test_a_completion_switched_mid_generation_has_every_position_routed(service: RolloutHarness, model_dir,
                                                                        fingerprint) -> None:
    from lorarl.contract.routes import RoutedExperts

    load(service, "r3", 1, policy_weights(model_dir, seed=7), fingerprint)
    total = 200
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", generate(
        service.stub, PROMPT, greedy(total), "r3")))
    worker.start()
    while service.core.status().in_flight == 0 and worker.is_alive():
        threading.Event().wait(0.01)
    threading.Event().wait(0.3)
    load(service, "r3", 2, policy_weights(model_dir, seed=8), fingerprint)
    worker.join(120)
    out = result["out"]
    versions = list(out.token_versions)
    routes = RoutedExperts.from_proto(out.routed_experts)
    assert routes is not None and routes.positions == len(PROMPT) + total - 1 and routes.recorded_fraction == 1.0
    assert versions[0] == 1 and versions[-1] == 2  # two segments, their routes laid end to end
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="r3"))
