"""The rollout service on real vLLM (fp32, enforce_eager) behind gRPC, dense model: one engine for the module.

Parity with transformers+PEFT, merged == adapter, the transformers engine as a cross-check, version
tags across a switch mid-generation, batching of concurrent requests, and a clear status for each
bad input while other requests carry on.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from lorarl.common.cpu_affinity import available_cpus
from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.contract.lora import LoraSpec
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.factory import start_core
from lorarl.rollout.payloads import PolicyPayload
from lorarl.rollout.schema import GenerateInput, Mode, PolicyRef, Sampling
from lorarl.v1 import common_pb2, rollout_pb2
from lorarl.weightsync.wire.payload import version_fingerprint
from tests.integration.rollout.harness import (
    RolloutHarness,
    field_of,
    generate,
    greedy,
    load_requests,
    merged_weights,
    reference_greedy,
    send_in_worker,
)
from tests.unit.rollout.models import LORA, PROMPT, dense_model_dir, random_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ADAPTER = common_pb2.SYNC_MODE_ADAPTER
MERGED = common_pb2.SYNC_MODE_MERGED
N_TOKENS = 24
QUEUE_LIMIT = 48


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return dense_model_dir()


@pytest.fixture(scope="module")
def service(model_dir: Path) -> Iterator[RolloutHarness]:
    settings = RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="float32", max_model_len=512,
                               kv_cache_gib=0.5, max_loras=4, adapter_window=3, max_queued_requests=QUEUE_LIMIT)
    harness = RolloutHarness(settings).start()
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def fingerprint(model_dir: Path) -> str:
    return base_model_fingerprint(model_dir)


@pytest.fixture(scope="module")
def adapter(model_dir: Path) -> dict[str, torch.Tensor]:
    return random_adapter(model_dir, seed=1)


@pytest.fixture(scope="module")
def reference(model_dir: Path, adapter: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], list[float]]]:
    return {"base": reference_greedy(model_dir, PROMPT, N_TOKENS),
            "adapter": reference_greedy(model_dir, PROMPT, N_TOKENS, adapter, LORA)}


def load(service: RolloutHarness, job: str, version: int, tensors: dict, mode: int, fingerprint: str,
         lora: LoraSpec = LORA, **kwargs: object) -> rollout_pb2.LoadWeightsResponse:
    lora = lora if mode == ADAPTER else None
    return service.stub.LoadWeights(load_requests(job, version, tensors, mode, fingerprint, lora, **kwargs),
                                    timeout=120)


def test_capabilities_status_and_internals(service: RolloutHarness, fingerprint: str) -> None:
    caps = service.stub.GetCapabilities(rollout_pb2.GetCapabilitiesRequest())
    assert caps.engine == "vllm" and caps.supports_lora and caps.reason == ""
    assert list(caps.modes) == [ADAPTER, MERGED]
    assert (caps.max_lora_rank, caps.max_loras, caps.adapter_window) == (16, 4, 3)
    assert (caps.vocab_size, caps.max_model_len, caps.base_model_fingerprint) == (264, 512, fingerprint)
    probe = service.call(service.core.engine.probe())
    assert probe and all(probe.values()), probe
    status = service.stub.GetReplicaStatus(rollout_pb2.GetReplicaStatusRequest())
    assert status.replica_id and not status.paused


def test_adapter_version_matches_transformers_peft(service: RolloutHarness, adapter, reference, fingerprint) -> None:
    base = generate(service.stub, PROMPT, greedy(N_TOKENS))
    assert list(base.token_ids) == reference["base"][0]
    assert list(base.token_versions) == [0] * N_TOKENS
    assert load(service, "peft", 1, adapter, ADAPTER, fingerprint).version == 1
    out = generate(service.stub, PROMPT, greedy(N_TOKENS), "peft", 1)
    # the completion names the weights it was served with: the digest of the payload loaded as v1
    manifest = next(load_requests("peft", 1, adapter, ADAPTER, fingerprint, LORA)).manifest
    assert dict(out.policy_fingerprints) == {1: version_fingerprint(manifest)}
    assert dict(base.policy_fingerprints) == {}  # the base model has none
    tokens, logprobs = reference["adapter"]
    assert list(out.token_ids) == tokens
    torch.testing.assert_close(torch.tensor(list(out.logprobs)), torch.tensor(logprobs), atol=2e-4, rtol=0)
    assert list(out.token_versions) == [1] * N_TOKENS
    assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH and out.text
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="peft"))


def test_prompt_logprobs_are_the_policys_own(service: RolloutHarness, adapter, reference, fingerprint) -> None:
    """Generate with prompt_logprobs (the Tinker front's compute_logprobs): on a prompt that is the adapter's
    own greedy continuation, the prompt tokens' logprobs are transformers+PEFT's for those tokens, the first
    NaN; asked once per prompt, whatever n; refused on the stream."""
    load(service, "prompt-lp", 1, adapter, ADAPTER, fingerprint)
    tokens, logprobs = reference["adapter"]
    prompt = (*PROMPT, *tokens[:8])
    sampling = common_pb2.SamplingParams(n=3, temperature=1.0, max_tokens=2, prompt_logprobs=True)
    reply = service.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=prompt)], sampling=sampling,
        policy=rollout_pb2.PolicySelector(job_id="prompt-lp", version=1)), timeout=120)
    (result,) = reply.results
    got = list(result.prompt_logprobs)
    assert len(got) == len(prompt) and got[0] != got[0] and len(result.completions) == 3  # NaN first
    torch.testing.assert_close(torch.tensor(got[len(PROMPT):]), torch.tensor(logprobs[:8]), atol=2e-4, rtol=0)
    plain = service.stub.Generate(rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=prompt)],
                                                              sampling=greedy(2)), timeout=120)
    assert not plain.results[0].prompt_logprobs  # only when asked
    with pytest.raises(grpc.RpcError) as refused:
        list(service.stub.GenerateStream(rollout_pb2.GenerateStreamRequest(
            prompt=rollout_pb2.Prompt(token_ids=prompt), sampling=sampling), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in refused.value.details()
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="prompt-lp"))


def test_prompt_logprobs_next_to_other_adapters_requests(service: RolloutHarness, model_dir, adapter, reference,
                                                        fingerprint) -> None:
    """A prompt-logprob request in the same engine steps as other adapters' and the base's requests: vLLM CPU's
    logits LoRA indexed the prompt rows with the batch's per-sequence indices and its engine core died
    (IndexError: the served-policy guard's probe in an async run); lorarl's CPU LoRA ops add the (zero)
    lm_head delta exactly instead (lorarl/rollout/vllm/cpu_lora_ops.py)."""
    load(service, "lp-mine", 1, adapter, ADAPTER, fingerprint)
    load(service, "lp-other", 1, random_adapter(model_dir, seed=3), ADAPTER, fingerprint)
    tokens, logprobs = reference["adapter"]
    prompt = (*PROMPT, *tokens[:8])
    busy = [service.stub.Generate.future(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=greedy(96),
        policy=rollout_pb2.PolicySelector(job_id=job, version=1 if job else 0)), timeout=120)
        for job in ("lp-other", "", "lp-other")]
    time.sleep(0.2)  # the others are decoding when the prompt-logprob request arrives
    reply = service.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=prompt)],
        sampling=common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=2, prompt_logprobs=True),
        policy=rollout_pb2.PolicySelector(job_id="lp-mine", version=1)), timeout=120)
    got = list(reply.results[0].prompt_logprobs)
    torch.testing.assert_close(torch.tensor(got[len(PROMPT):]), torch.tensor(logprobs[:8]), atol=2e-4, rtol=0)
    assert all(len(f.result().results[0].completions[0].token_ids) == 96 for f in busy)
    for job in ("lp-mine", "lp-other"):
        service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=job))


def test_several_jobs_side_by_side_on_one_base(service: RolloutHarness, model_dir, adapter, reference,
                                                fingerprint) -> None:
    load(service, "one", 1, adapter, ADAPTER, fingerprint)
    load(service, "two", 1, random_adapter(model_dir, seed=2), ADAPTER, fingerprint)
    alone = list(generate(service.stub, PROMPT, greedy(N_TOKENS), "two").token_ids)

    def call(job: str) -> grpc.Future:
        return service.stub.Generate.future(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=greedy(N_TOKENS),
            policy=rollout_pb2.PolicySelector(job_id=job)), timeout=60)

    expected = {"": reference["base"][0], "one": reference["adapter"][0], "two": alone}
    futures = [(job, call(job)) for job in ("", "one", "two", "one", "", "two")]
    for job, future in futures:
        assert list(future.result().results[0].completions[0].token_ids) == expected[job], job
    for job in ("one", "two"):
        service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=job))


@pytest.mark.skipif(len(available_cpus()) < 2, reason="needs two CPUs to tell pinned from unpinned")
def test_engine_core_runs_on_the_cpus_it_is_pinned_to(service: RolloutHarness) -> None:
    """The worker pins every thread of the engine core's process (what rollout.engine_cpus asks at start)
    and the engine keeps serving; pinning it to every CPU again undoes it."""
    llm = service.core.engine.llm
    cpus = available_cpus()

    def pin(to: list[int]) -> list[int]:
        return service.call(llm.collective_rpc("lorarl_pin_cpus", kwargs={"cpus": to}))[0]

    try:
        pinned = pin(cpus[-1:])
        tokens = list(generate(service.stub, PROMPT, greedy(N_TOKENS)).token_ids)
    finally:
        restored = pin(cpus)
    assert pinned == cpus[-1:]
    assert restored == cpus
    assert len(tokens) == N_TOKENS


def test_cpu_lora_speedups_match_vllms_own_ops(service: RolloutHarness, model_dir, fingerprint) -> None:
    """On CPU the worker swaps vLLM's LoRA application for grouped ops and a lean add_lora_linear
    (lorarl/rollout/vllm/worker_ext.py); switched off, the engine runs vLLM's own ops. Greedy tokens
    and logprobs agree with the lean path alone and with both: a batch of prompts on one adapter, and
    two adapters plus base-model requests (index -1) in one batch, prefills and decodes."""
    load(service, "lean-a", 1, random_adapter(model_dir, seed=31), ADAPTER, fingerprint)
    load(service, "lean-b", 1, random_adapter(model_dir, seed=32), ADAPTER, fingerprint)
    llm = service.core.engine.llm
    prompts = [PROMPT, PROMPT[:6], tuple(range(1, 20)), (5, 9, 200, 31)]

    def rpc(method: str, **kwargs: object) -> object:
        return service.call(llm.collective_rpc(method, kwargs=kwargs))[0]

    def request(job: str, batch: list[tuple[int, ...]]) -> rollout_pb2.GenerateRequest:
        return rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=p) for p in batch],
                                           sampling=greedy(N_TOKENS), policy=rollout_pb2.PolicySelector(job_id=job))

    def run() -> list[tuple[list[int], list[float]]]:
        responses = [service.stub.Generate(request("lean-a", prompts), timeout=120)]
        mixed = [service.stub.Generate.future(request(job, [prompts[i % len(prompts)]]), timeout=120)
                 for i, job in enumerate(["", "lean-a", "lean-b", "lean-b", "", "lean-a"])]
        responses += [future.result() for future in mixed]
        return [(list(c.token_ids), list(c.logprobs)) for r in responses for res in r.results for c in res.completions]

    try:
        rpc("lorarl_install_cpu_fixes", lean_lora=False, grouped_lora=False)
        vllm_ops = run()
        rpc("lorarl_install_cpu_fixes", lean_lora=True, grouped_lora=False)
        lean = run()
        state = rpc("lorarl_lean_lora_state")
        rpc("lorarl_install_cpu_fixes")  # what the service installs: grouped ops + lean path
        both = run()
    finally:
        rpc("lorarl_install_cpu_fixes")
    assert state == {"wrappers": 1, "layers": 16, "builds": 16}  # 4 x (qkv, o, gate_up, down), built once
    assert len(vllm_ops) == len(prompts) + 6
    for other in (lean, both):
        for (tokens, logprobs), (got_tokens, got_logprobs) in zip(vllm_ops, other, strict=True):
            assert got_tokens == tokens
            torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
    for job in ("lean-a", "lean-b"):
        service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=job))


def test_base_requests_get_no_adapter_while_every_slot_holds_one(service: RolloutHarness, model_dir, reference,
                                                                fingerprint) -> None:
    """A base-model request (adapter index -1) batched with adapter requests while all max_loras slots
    hold adapters gets the base model's tokens with our CPU LoRA paths (the service default). vLLM's
    own CPU ops read the last slot for index -1 rows, so there the base request gets that adapter's
    tokens: the bug lorarl/rollout/vllm/cpu_lora_ops.py deliberately does not reproduce. Runs after
    test_cpu_lora_speedups_match_vllms_own_ops, which needs the last slot never written; unloading
    leaves slot 3 with stale weights, which the fixed paths ignore."""
    jobs = [f"full-{i}" for i in range(4)]  # max_loras=4: loaded in order into the free slots 0..3
    llm = service.core.engine.llm
    loaded: list[str] = []

    def rpc(method: str, **kwargs: object) -> object:
        return service.call(llm.collective_rpc(method, kwargs=kwargs))[0]

    def request(job: str, tokens: int) -> rollout_pb2.GenerateRequest:
        return rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=greedy(tokens),
                                           policy=rollout_pb2.PolicySelector(job_id=job))

    def mixed() -> tuple[list[tuple[str, list[int], list[float]]], list[int]]:
        """Base and adapter requests in one batch; a long stream on jobs[0], started first, keeps an
        adapter row in every step they run in (so vLLM's no_lora shortcut never applies)."""
        stream = service.stub.GenerateStream(rollout_pb2.GenerateStreamRequest(
            prompt=rollout_pb2.Prompt(token_ids=PROMPT), sampling=greedy(300),
            policy=rollout_pb2.PolicySelector(job_id=jobs[0])), timeout=120)
        streamed = list(next(stream).token_ids)
        futures = [(job, service.stub.Generate.future(request(job, N_TOKENS), timeout=120))
                   for job in ["", jobs[3], "", jobs[1], jobs[2], ""]]
        results = [(job, list(c.token_ids), list(c.logprobs)) for job, future in futures
                   for c in [future.result().results[0].completions[0]]]
        streamed += [t for message in stream for t in message.token_ids]
        return results, streamed

    try:
        for i, job in enumerate(jobs):
            load(service, job, 1, random_adapter(model_dir, seed=41 + i), ADAPTER, fingerprint)
            loaded.append(job)
        alone = {job: list(generate(service.stub, PROMPT, greedy(N_TOKENS), job).token_ids) for job in jobs}
        ours, ours_streamed = mixed()
        rpc("lorarl_install_cpu_fixes", lean_lora=False, grouped_lora=False)
        theirs, theirs_streamed = mixed()
    finally:
        rpc("lorarl_install_cpu_fixes")
        for job in loaded:
            service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=job))
    base_tokens, base_logprobs = reference["base"]
    assert all(tokens != base_tokens for tokens in alone.values())  # each adapter visibly changes the output
    assert len(ours_streamed) == len(theirs_streamed) == 300
    assert ours_streamed[:N_TOKENS] == theirs_streamed[:N_TOKENS] == alone[jobs[0]]
    for job, tokens, logprobs in ours:
        if job:
            assert tokens == alone[job], job
        else:
            assert tokens == base_tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(base_logprobs), atol=2e-4, rtol=0)
    # vLLM's own CPU ops: adapter requests are right, base requests get the last slot's adapter.
    for job, tokens, _ in theirs:
        assert tokens == alone[job or jobs[-1]], job or "base"


def test_merged_equals_adapter_and_the_transformers_engine_agrees(service: RolloutHarness, model_dir, adapter,
                                                                 reference, fingerprint) -> None:
    load(service, "merged", 1, merged_weights(model_dir, adapter, LORA), MERGED, fingerprint)
    out = generate(service.stub, PROMPT, greedy(N_TOKENS), "merged")
    assert list(out.token_ids) == reference["adapter"][0]
    assert list(out.token_versions) == [1] * N_TOKENS
    torch.testing.assert_close(torch.tensor(list(out.logprobs)), torch.tensor(reference["adapter"][1]), atol=2e-4,
                               rtol=0)
    base_blocked = pytest.raises(grpc.RpcError)
    with base_blocked as info:
        generate(service.stub, PROMPT, greedy(4))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "merged" in info.value.details()
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="merged"))
    assert list(generate(service.stub, PROMPT, greedy(N_TOKENS)).token_ids) == reference["base"][0]

    async def hf_engine() -> dict[str, list[int]]:
        settings = RolloutSettings(model_path=str(model_dir), engine="hf", dtype="float32")
        core = await start_core(settings)
        sampling = Sampling(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
        outputs = {}
        for name, policy in [("base", PolicyRef()), ("adapter", PolicyRef("a")), ("merged", PolicyRef("m"))]:
            if name == "adapter":
                await core.load(PolicyPayload("a", 1, Mode.ADAPTER, Mode.ADAPTER, fingerprint, adapter, LORA))
            if name == "merged":
                await core.unload("a")
                await core.load(PolicyPayload("m", 1, Mode.ADAPTER, Mode.MERGED, fingerprint, adapter, LORA))
            [result] = await core.generate(GenerateInput(name, (PROMPT,), sampling, policy))
            outputs[name] = result.completions[0].token_ids
        await core.close()
        return outputs

    hf = asyncio.run(hf_engine())
    assert hf == {"base": reference["base"][0], "adapter": reference["adapter"][0], "merged": reference["adapter"][0]}


def test_version_tags_across_a_merged_switch_mid_generation(service: RolloutHarness, model_dir, fingerprint) -> None:
    first = merged_weights(model_dir, random_adapter(model_dir, seed=11), LORA)
    second = merged_weights(model_dir, random_adapter(model_dir, seed=12), LORA)
    load(service, "switch", 1, first, MERGED, fingerprint)
    total = 400
    stream = service.stub.GenerateStream(rollout_pb2.GenerateStreamRequest(
        prompt=rollout_pb2.Prompt(token_ids=PROMPT), sampling=greedy(total),
        policy=rollout_pb2.PolicySelector(job_id="switch")), timeout=120)
    unary = service.stub.Generate.future(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=greedy(total),
        policy=rollout_pb2.PolicySelector(job_id="switch")), timeout=120)
    tokens, versions, finishes, switched = [], [], [], None
    for message in stream:
        tokens += message.token_ids
        versions += message.token_versions
        if message.finish_reason:
            finishes.append(message.finish_reason)
        if switched is None and len(tokens) >= 30:
            switched = threading.Thread(target=load, args=(service, "switch", 2, second, MERGED, fingerprint))
            switched.start()
    assert switched is not None
    switched.join(60)
    assert finishes == [common_pb2.FINISH_REASON_LENGTH] and len(tokens) == total
    k = versions.index(2)
    assert 30 <= k < total and versions == [1] * k + [2] * (total - k)
    # The tokens after the switch are exactly what v2 produces from the prompt plus the tokens before it.
    rest = generate(service.stub, PROMPT + tuple(tokens[:k]), greedy(total - k), "switch", 2)
    assert list(rest.token_ids) == tokens[k:]
    # A unary request (tokens delivered at the end) is interrupted and continued the same way.
    out = unary.result().results[0].completions[0]
    k = list(out.token_versions).index(2)
    assert len(out.token_ids) == total and list(out.token_versions) == [1] * k + [2] * (total - k)
    assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="switch"))


def test_pinned_adapter_request_finishes_on_its_version_while_a_new_one_loads(service: RolloutHarness, model_dir,
                                                                             fingerprint) -> None:
    load(service, "pin", 1, random_adapter(model_dir, seed=21), ADAPTER, fingerprint)
    future = service.stub.Generate.future(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=greedy(300),
        policy=rollout_pb2.PolicySelector(job_id="pin", version=1)), timeout=120)
    time.sleep(0.2)
    load(service, "pin", 2, random_adapter(model_dir, seed=22), ADAPTER, fingerprint)
    out = future.result().results[0].completions[0]
    assert list(out.token_versions) == [1] * 300 and out.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert set(generate(service.stub, PROMPT, greedy(5), "pin").token_versions) == {2}
    status = service.stub.GetReplicaStatus(rollout_pb2.GetReplicaStatusRequest())
    assert {(p.job_id, p.version, p.active) for p in status.policies if p.job_id == "pin"} == {("pin", 1, False),
                                                                                            ("pin", 2, True)}
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="pin"))


def test_concurrent_requests_are_batched(service: RolloutHarness) -> None:
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=3)
    request = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=sampling)
    start = time.perf_counter()
    for _ in range(2):
        service.stub.Generate(request, timeout=60)
    single = (time.perf_counter() - start) / 2
    count = 16
    start = time.perf_counter()
    futures = [service.stub.Generate.future(request, timeout=120) for _ in range(count)]
    results = [f.result() for f in futures]
    concurrent = time.perf_counter() - start
    assert all(len(r.results[0].completions[0].token_ids) == 64 for r in results)
    assert concurrent < 0.5 * count * single, f"{count} concurrent took {concurrent:.2f} s, one alone {single:.2f} s"
    status = service.stub.GetReplicaStatus(rollout_pb2.GetReplicaStatusRequest())
    assert status.peak_running_requests > 1


def test_bad_inputs_get_clear_statuses_while_others_continue(service: RolloutHarness, model_dir, adapter,
                                                            fingerprint) -> None:
    background = service.stub.GenerateStream(rollout_pb2.GenerateStreamRequest(
        prompt=rollout_pb2.Prompt(token_ids=PROMPT), sampling=greedy(300)), timeout=120)
    load(service, "bad", 1, adapter, ADAPTER, fingerprint)

    def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, str | None]:
        with pytest.raises(grpc.RpcError) as info:
            call()
        return info.value.code(), info.value.details(), field_of(info.value)

    def gen(prompt: list[int], **sampling: object) -> Callable[[], object]:
        params = common_pb2.SamplingParams(max_tokens=4, **sampling)
        return lambda: service.stub.Generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=prompt)], sampling=params))

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(gen([]))[::2] == (invalid, "prompts[0]")
    assert code_of(gen(list(range(200)) * 3))[::2] == (invalid, "prompts[0]")
    assert code_of(gen([1, 264]))[::2] == (invalid, "prompts[0].token_ids[1]")
    assert code_of(gen([1, 2], temperature=-1.0))[::2] == (invalid, "sampling.temperature")
    assert code_of(gen([1, 2], top_p=2.0))[::2] == (invalid, "sampling.top_p")
    assert code_of(gen([1, 2], n=1000))[::2] == (invalid, "sampling.n")
    assert code_of(lambda: generate(service.stub, PROMPT, greedy(4), "no-such-job"))[:1] == (grpc.StatusCode.NOT_FOUND,)
    code, details, _ = code_of(lambda: generate(service.stub, PROMPT, greedy(4), "bad", 99))
    assert code == grpc.StatusCode.NOT_FOUND and "bad v99" in details
    code, details, _ = code_of(lambda: load(service, "bad", 2, random_adapter(model_dir, rank=32), ADAPTER,
                                            fingerprint, LoraSpec(32, 64.0, ())))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "max_lora_rank" in details
    code, details, _ = code_of(lambda: load(service, "bad", 2, adapter, ADAPTER, "sha256:someone-else"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "sha256:someone-else" in details
    code, details, _ = code_of(lambda: service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="nope")))
    assert code == grpc.StatusCode.NOT_FOUND
    code, details, _ = code_of(gen(list(PROMPT), n=QUEUE_LIMIT, ignore_eos=True))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_requests" in details

    tokens = [t for message in background for t in message.token_ids]
    assert len(tokens) == 300  # the request in flight was never disturbed
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="bad"))


def test_failed_loads_keep_the_previous_version_serving(service: RolloutHarness, model_dir, adapter,
                                                        fingerprint) -> None:
    load(service, "keep", 1, adapter, ADAPTER, fingerprint)
    before = generate(service.stub, PROMPT, greedy(N_TOKENS), "keep")
    wrong_shape = {n: (t[:, :-1] if "lora_A" in n else t) for n, t in adapter.items()}
    failures = [
        (lambda: load(service, "keep", 2, wrong_shape, ADAPTER, fingerprint), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda: load(service, "keep", 2, adapter, ADAPTER, fingerprint, corrupt=True),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: load(service, "keep", 2, {"model.norm.weight": torch.ones(128)}, MERGED, fingerprint),
         grpc.StatusCode.FAILED_PRECONDITION),
    ]
    for call, code in failures:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code, info.value.details()
    after = generate(service.stub, PROMPT, greedy(N_TOKENS), "keep")
    assert list(after.token_ids) == list(before.token_ids) and set(after.token_versions) == {1}
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="keep"))


def test_a_version_loaded_again_with_other_weights_never_reuses_its_cached_prompt(
        service: RolloutHarness, model_dir, adapter, fingerprint) -> None:
    """Committing an adapter does not reset the prefix cache; each load has its own cache key instead.
    A 200-token prompt fills a whole KV block (128 tokens on CPU) that vLLM caches; loading the same
    job and version again with other weights must recompute it, not reuse KV made by the first ones."""
    prompt = (PROMPT * 20)[:200]
    other = random_adapter(model_dir, seed=3)
    load(service, "again", 1, adapter, ADAPTER, fingerprint)
    first = generate(service.stub, prompt, greedy(4), "again")
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="again"))
    load(service, "again", 1, other, ADAPTER, fingerprint)
    second = generate(service.stub, prompt, greedy(4), "again")
    tokens, logprobs = reference_greedy(model_dir, prompt, 4, other, LORA)
    assert list(second.token_ids) == tokens
    torch.testing.assert_close(torch.tensor(list(second.logprobs)), torch.tensor(logprobs), atol=2e-4, rtol=0)
    assert list(first.logprobs) != list(second.logprobs)
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="again"))


def test_pause_resume_and_abort(service: RolloutHarness) -> None:
    service.stub.Pause(rollout_pb2.PauseRequest())
    future = service.stub.Generate.future(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=greedy(8)), timeout=60)
    time.sleep(0.5)
    assert not future.done()
    assert service.stub.GetReplicaStatus(rollout_pb2.GetReplicaStatusRequest()).paused
    service.stub.Resume(rollout_pb2.ResumeRequest())
    assert len(future.result().results[0].completions[0].token_ids) == 8

    unary = service.stub.Generate.future(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=greedy(450), request_id="unary"), timeout=60)
    # the unary call in the engine before the stream starts: once the stream has a token, the engine has stepped
    # the unary request too, so its abort below returns a partial (a busy CI machine once delivered the unary
    # call after the stream's first token, and it was aborted with none)
    deadline = time.monotonic() + 30
    while service.stub.GetReplicaStatus(rollout_pb2.GetReplicaStatusRequest()).requests_in_flight < 1:
        assert time.monotonic() < deadline and not unary.done(), "the unary request never reached the engine"
        time.sleep(0.01)
    stream = service.stub.GenerateStream(rollout_pb2.GenerateStreamRequest(
        prompt=rollout_pb2.Prompt(token_ids=PROMPT), sampling=greedy(450), request_id="long"), timeout=60)
    first = next(stream)
    assert service.stub.Abort(rollout_pb2.AbortRequest(request_ids=["long"])).aborted == 1
    rest = list(stream)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) < 450
    assert service.stub.Abort(rollout_pb2.AbortRequest(request_ids=["unary"])).aborted == 1
    partial = unary.result().results[0].completions[0]
    assert partial.finish_reason == common_pb2.FINISH_REASON_ABORT and 0 < len(partial.token_ids) < 450
    assert len(partial.logprobs) == len(partial.token_versions) == len(partial.token_ids)


def test_weight_sync_sink_with_a_local_merge(service: RolloutHarness, model_dir, adapter, reference,
                                             fingerprint) -> None:
    from lorarl.rollout.sink import RolloutSink
    from lorarl.weightsync.client.sinks import PolicyUpdate
    from lorarl.weightsync.wire.payload import build_manifest, pack

    sink = RolloutSink(service.core, service.loop)
    manifest = build_manifest(job_id="sync", version=1, mode=ADAPTER, base_model_fingerprint=fingerprint,
                              buckets=list(pack(sorted(adapter.items()))), lora=common_pb2.LoraSpec(rank=8, alpha=16))
    sink.stage(PolicyUpdate(manifest, adapter, MERGED))  # the replica is told to merge the adapter itself
    assert sink.active_versions().get("sync", 0) == 0
    sink.commit("sync", 1)
    assert sink.active_versions()["sync"] == 1
    assert list(generate(service.stub, PROMPT, greedy(N_TOKENS), "sync").token_ids) == reference["adapter"][0]
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="sync"))


def test_layerwise_reload_serves_what_the_workers_own_reload_serves(service: RolloutHarness, model_dir, adapter,
                                                                    reference) -> None:
    """vllm-ascend 0.23's NPU worker has no reload_weights; compat.reload_weights then runs the layerwise
    sequence vllm-ascend's own RL update runs. Both ways run here on one CPU engine, alternating; vLLM's
    CPU backend moves linear weights into oneDNN handles (parameters left empty), so what is compared
    is what the engine computes: greedy tokens and their logprobs, bit for bit."""
    from safetensors.torch import load_file

    engine = service.core.engine

    def reload(weights: dict[str, torch.Tensor], way: str) -> tuple[list[int], list[float]]:
        service.call(engine.stage_weights("parity", weights.items()))
        service.call(engine.llm.collective_rpc("lorarl_load_weights", kwargs={"token": "parity", "way": way}))
        service.call(engine.reset_prefix_cache())
        out = generate(service.stub, PROMPT, greedy(N_TOKENS))  # a base request: the core loaded nothing
        return list(out.token_ids), list(out.logprobs)

    base_weights = {n: t for f in sorted(model_dir.glob("*.safetensors")) for n, t in load_file(f).items()}
    merged = merged_weights(model_dir, adapter, LORA)
    by_worker = reload(merged, "worker")
    assert by_worker[0] == reference["adapter"][0]
    assert reload(base_weights, "layerwise")[0] == reference["base"][0]
    assert reload(merged, "layerwise") == by_worker
    assert reload(base_weights, "worker")[0] == reference["base"][0]


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_receiving_in_the_worker_serves_what_receiving_in_the_service_serves(service: RolloutHarness, model_dir,
                                                                             adapter, reference, fingerprint,
                                                                             mode: str) -> None:
    """rollout.receive_in_worker: the same version, once through the service's own receive (LoadWeights)
    and once received by vLLM's worker over a gloo group: the same greedy tokens, logprobs bit for bit."""
    tensors = adapter if mode == "adapter" else merged_weights(model_dir, adapter, LORA)
    wire = ADAPTER if mode == "adapter" else MERGED
    load(service, f"svc-{mode}", 1, tensors, wire, fingerprint)
    by_service = generate(service.stub, PROMPT, greedy(N_TOKENS), f"svc-{mode}")
    assert list(by_service.token_ids) == reference["adapter"][0]
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=f"svc-{mode}"))
    engine = service.core.engine
    engine.receives_in_worker = True  # 'auto' leaves it off on CPU
    try:
        send_in_worker(service, f"wrk-{mode}", tensors, wire, wire, fingerprint)
    finally:
        engine.receives_in_worker = False
    by_worker = generate(service.stub, PROMPT, greedy(N_TOKENS), f"wrk-{mode}")
    assert list(by_worker.token_ids) == list(by_service.token_ids)
    assert list(by_worker.logprobs) == list(by_service.logprobs)
    assert list(by_worker.token_versions) == [1] * N_TOKENS
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=f"wrk-{mode}"))


def test_a_version_received_in_the_worker_and_refused_leaves_nothing_behind(service: RolloutHarness, adapter,
                                                                            reference) -> None:
    engine = service.core.engine
    engine.receives_in_worker = True
    try:
        with pytest.raises(Exception, match="was made for base model"):
            send_in_worker(service, "wrk-refused", adapter, ADAPTER, ADAPTER, "another-base")
    finally:
        engine.receives_in_worker = False
    assert "wrk-refused" not in service.core.active_versions()
    assert list(generate(service.stub, PROMPT, greedy(N_TOKENS)).token_ids) == reference["base"][0]


@torch.no_grad()
def scored(model_dir: Path, prompt: list[int], completion: list[int], adapter: dict | None = None) -> list[float]:
    """transformers(+PEFT)'s logprobs of ``completion`` after ``prompt``: what the trainer scores a probe with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapter})
        model = get_peft_model(model, LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=targets,
                                                 lora_dropout=0.0))
        set_peft_model_state_dict(model, dict(adapter))
        model.eval()
    logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]


class TrainerScores:
    """The trainer's side of the guard: its ComputeLogprobs of the probe (the adapter it published; the base)."""

    def __init__(self, policy: list[float], base: list[float]) -> None:
        self.policy, self.base = policy, base

    async def ComputeLogprobs(self, request: Any) -> Any:  # noqa: N802 (the gRPC method's name)
        from lorarl.v1 import trainer_pb2

        scores = self.base if request.reference else self.policy
        return trainer_pb2.ComputeLogprobsResponse(results=[trainer_pb2.TokenLogprobs(logprobs=scores)])


def test_the_policy_guard_catches_each_broken_link(service: RolloutHarness, model_dir, adapter, reference,
                                                   fingerprint, monkeypatch: pytest.MonkeyPatch) -> None:
    """lorarl.client.rl.guard on a real replica: the version a trainer published (``adapter``) passes; each link of
    the serving path broken on purpose fails it, and says whether the replica serves the base."""
    import dataclasses

    from lorarl.client.job.config import PolicyGuardSection
    from lorarl.client.rl.guard import PolicyGuard, PolicyGuardError, Probe
    from lorarl.common.channel import aio_channel
    from lorarl.v1 import rollout_pb2_grpc
    from tests.integration.rollout.harness import TOKEN

    probe = Probe(list(PROMPT), reference["adapter"][0][:12])
    trainer = TrainerScores(scored(model_dir, probe.prompt, probe.completion, adapter),
                            scored(model_dir, probe.prompt, probe.completion))
    engine = service.core.engine

    def check(version: int) -> float:
        async def run() -> float:
            guard = PolicyGuard(PolicyGuardSection(action="fail"), probe)
            await guard.expect(trainer, "guard", version)
            async with aio_channel(service.running.address, token=TOKEN) as channel:
                [verdict] = await guard.check([("rollout-0", rollout_pb2_grpc.RolloutServiceStub(channel))], "guard",
                                              version)
            return verdict.diff

        return asyncio.run(run())

    load(service, "guard", 1, random_adapter(model_dir, seed=2), ADAPTER, fingerprint)  # an older policy
    load(service, "guard", 2, adapter, ADAPTER, fingerprint)  # the version the trainer just published
    assert check(2) < 1e-3  # healthy: the replica serves what the trainer scores

    # requests without their adapter (verl #5220): the base serves
    original_submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda spec: original_submit(dataclasses.replace(spec, adapter=None)))
    with pytest.raises(PolicyGuardError, match="serves the base"):
        check(2)
    monkeypatch.setattr(engine, "submit", original_submit)

    # the new adapter never reached the serving layer (ART #661): v2's requests run v1's registration
    ids = {v: service.core.table.get("guard", v).adapter.lora_int_id for v in (1, 2)}
    real = engine._lora_requests[ids[2]]
    engine._lora_requests[ids[2]] = engine._lora_requests[ids[1]]
    with pytest.raises(PolicyGuardError, match="other weights"):
        check(2)
    engine._lora_requests[ids[2]] = real
    assert check(2) < 1e-3

    # a sync that pushed no adapter effect (verl #7495: the base went out instead): lora_B all zero
    load(service, "guard", 3, {n: torch.zeros_like(t) if "lora_B" in n else t for n, t in adapter.items()}, ADAPTER,
         fingerprint)
    with pytest.raises(PolicyGuardError, match="serves the base"):
        check(3)

    # a module of the adapter dropped on the way (vLLM #51594's lm_head, here o_proj)
    load(service, "guard", 4, {n: t for n, t in adapter.items() if "o_proj" not in n}, ADAPTER, fingerprint)
    with pytest.raises(PolicyGuardError, match="replica rollout-0 serves version 4"):
        check(4)
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="guard"))


def trainer_scores(model_dir: Path, adapter: dict[str, torch.Tensor], rows: list[tuple[list[int], list[int]]],
                   tmp: Path) -> list[list[float]]:
    """The trainer's own logprobs of each (prompt, completion) under ``adapter``, read from its PEFT directory as
    a teacher is (lorarl.contract.peft): the torch engine warm-started from it."""
    from lorarl.contract.peft import write_peft_files
    from lorarl.contract.training import TrainingSpec
    from lorarl.trainer.engines.torch.engine import TorchEngine
    from lorarl.trainer.rl.trajectory import TrajectoryRecord

    directory = write_peft_files(tmp, adapter, LORA.peft_config("tiny", sorted(
        {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapter})))
    engine = TorchEngine(TrainingSpec(base_model_path=str(model_dir), lora=LoraSpec(rank=LORA.rank, alpha=LORA.alpha),
                                      init_adapter_path=str(directory), device="cpu"))
    return engine.compute_logprobs([TrajectoryRecord(p, c, [0.0] * len(c), [0] * len(c), 0.0) for p, c in rows])


def test_teachers_score_the_students_completions_in_this_engine(service: RolloutHarness, model_dir, adapter,
                                                                fingerprint, tmp_path: Path) -> None:
    """On-policy distillation (#47): two teacher adapters loaded beside the student's, one Generate samples the
    student and has each prompt's completions scored by its teacher (or a mixture of both) in the same engine;
    each teacher's logprobs are the trainer's for that adapter on the same tokens (1e-3), and no engine process
    starts for them."""
    import psutil

    teachers = {"teach-a": adapter, "teach-b": random_adapter(model_dir, seed=3)}
    for job, tensors in teachers.items():
        load(service, job, 1, tensors, ADAPTER, fingerprint)
    load(service, "student", 1, random_adapter(model_dir, seed=5, std=0.05), ADAPTER, fingerprint)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    prompts = [PROMPT, (*PROMPT, 49), (*PROMPT, 50)]
    weights = [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]
    reply = service.stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=p, teacher_weights=w) for p, w in zip(prompts, weights, strict=True)],
        sampling=common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=7),
        policy=rollout_pb2.PolicySelector(job_id="student", version=1),
        teachers=[rollout_pb2.PolicySelector(job_id=job, version=1) for job in teachers]), timeout=300)
    assert reply.teacher_seconds > 0
    assert {p.pid for p in psutil.Process().children(recursive=True)} == children  # no second engine
    rows = [(list(p), list(c.token_ids)) for p, r in zip(prompts, reply.results, strict=True) for c in r.completions]
    assert all(c for _, c in rows)
    want = {job: trainer_scores(model_dir, tensors, rows, tmp_path / job) for job, tensors in teachers.items()}
    got = [list(c.teacher_logprobs) for r in reply.results for c in r.completions]
    for i, (row, scores) in enumerate(zip(rows, got, strict=True)):
        a, b = torch.tensor(want["teach-a"][i]), torch.tensor(want["teach-b"][i])
        expected = a if i < 2 else b if i < 4 else torch.logaddexp(a, b) - math.log(2)
        assert len(scores) == len(row[1])
        torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-3, rtol=0)
    assert not torch.allclose(torch.tensor(want["teach-a"][0]), torch.tensor(want["teach-b"][0]), atol=1e-2)
    for job in (*teachers, "student"):
        service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=job))
