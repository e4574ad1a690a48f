"""The rollout core on a deterministic fake engine: version tags across switches, drains, limits, refusals."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import torch

from lorarl.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from lorarl.contract.lora import LoraSpec
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.core import RolloutCore
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.payloads import PolicyPayload
from lorarl.rollout.schema import CompletionChunk, Finish, GenerateInput, Mode, PolicyRef, Sampling
from tests.unit.rollout.fake_engine import FakeEngine, next_token
from tests.unit.rollout.models import LORA, PROMPT, dense_model_dir, random_adapter

T = TypeVar("T")


@pytest.fixture(scope="module")
def files() -> ModelFiles:
    return ModelFiles(dense_model_dir())


@pytest.fixture(scope="module")
def adapter(files: ModelFiles) -> dict[str, torch.Tensor]:
    return random_adapter(files.root)


def run(main: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(main())


def make_core(files: ModelFiles, engine: FakeEngine | None = None, **settings: Any) -> RolloutCore:
    engine = engine or FakeEngine(files)
    return RolloutCore(engine, RolloutSettings(**settings), files, fingerprint="sha256:base")


def adapter_payload(job: str, version: int, tensors: dict[str, torch.Tensor], lora: LoraSpec = LORA,
                    fingerprint: str = "sha256:base") -> PolicyPayload:
    return PolicyPayload(job, version, Mode.ADAPTER, Mode.ADAPTER, fingerprint, tensors, lora)


def merged_payload(files: ModelFiles, job: str, version: int) -> PolicyPayload:
    tensors = {"model.norm.weight": files.tensor("model.norm.weight") * (1 + version / 10)}
    return PolicyPayload(job, version, Mode.MERGED, Mode.MERGED, "sha256:base", tensors)


BASE = PolicyRef()


def request(policy: PolicyRef = BASE, max_tokens: int = 8, n: int = 1, request_id: str = "r") -> GenerateInput:
    return GenerateInput(request_id, (PROMPT,), Sampling(n=n, temperature=0.0, max_tokens=max_tokens), policy)


def expected_tokens(prefix: list[int], count: int, salt: str) -> list[int]:
    context = [*PROMPT, *prefix]
    out = []
    for _ in range(count):
        context.append(next_token(context, salt))
        out.append(context[-1])
    return out


async def stream_switching(core: RolloutCore, req: GenerateInput, after: int,
                           switch: Callable[[], Awaitable[None]]) -> tuple[list[int], list[int], Finish | None]:
    """Streams `req`, running `switch` once `after` tokens have arrived; returns tokens, versions, finish."""
    tokens: list[int] = []
    versions: list[int] = []
    finish = None
    switched = False
    async for chunk in core.generate_stream(req):
        tokens += chunk.token_ids
        versions += chunk.versions
        finish = chunk.finish or finish
        if len(tokens) >= after and not switched:
            switched = True
            await switch()
    return tokens, versions, finish


def test_base_generation_tags_every_token_with_version_zero(files: ModelFiles) -> None:
    async def main() -> None:
        core = make_core(files)
        [result] = await core.generate(request(max_tokens=6, n=3))
        assert len(result.completions) == 3
        for c in result.completions:
            assert c.token_ids == expected_tokens([], 6, "base")
            assert c.versions == [0] * 6 and c.finish is Finish.LENGTH

    run(main)


def test_adapter_versions_are_served_exactly_and_side_by_side(files: ModelFiles, adapter: dict) -> None:
    async def main() -> None:
        engine = FakeEngine(files)
        core = make_core(files, engine)
        await core.load(adapter_payload("a", 1, adapter))
        await core.load(adapter_payload("a", 2, adapter))
        await core.load(adapter_payload("b", 7, adapter))
        latest, pinned, other, base = await asyncio.gather(
            core.generate(request(PolicyRef("a"), request_id="1")),
            core.generate(request(PolicyRef("a", 1), request_id="2")),
            core.generate(request(PolicyRef("b"), request_id="3")),
            core.generate(request(request_id="4")))
        assert latest[0].completions[0].versions == [2] * 8
        assert latest[0].completions[0].token_ids == expected_tokens([], 8, "base+a-v2")
        assert pinned[0].completions[0].token_ids == expected_tokens([], 8, "base+a-v1")
        assert other[0].completions[0].versions == [7] * 8
        assert base[0].completions[0].versions == [0] * 8
        assert core.active_versions() == {"a": 2, "b": 7}
        # Committing an adapter makes no engine call (each load has its own prefix-cache key).
        assert "reset_prefix_cache" not in engine.calls

    run(main)


def test_merged_switch_mid_generation_continues_under_the_new_version(files: ModelFiles) -> None:
    async def main() -> None:
        engine = FakeEngine(files, supports_lora=False)
        core = make_core(files, engine)
        await core.load(merged_payload(files, "m", 1))
        tokens, versions, finish = await stream_switching(
            core, request(PolicyRef("m"), max_tokens=80), 20, lambda: core.load(merged_payload(files, "m", 2)))
        switch_at = versions.index(2)
        assert switch_at >= 20 and versions == [1] * switch_at + [2] * (80 - switch_at)
        assert finish is Finish.LENGTH and len(tokens) == 80
        assert tokens[:switch_at] == expected_tokens([], switch_at, "m:v1")
        assert tokens[switch_at:] == expected_tokens(tokens[:switch_at], 80 - switch_at, "m:v2")
        assert engine.calls[-4:] == ["pause", "load m:v2", "reset_prefix_cache", "resume"]

    run(main)


def test_request_pinned_to_a_replaced_merged_version_ends_with_abort(files: ModelFiles) -> None:
    async def main() -> None:
        core = make_core(files, FakeEngine(files, supports_lora=False))
        await core.load(merged_payload(files, "m", 1))
        tokens, versions, finish = await stream_switching(
            core, request(PolicyRef("m", 1), max_tokens=80), 10, lambda: core.load(merged_payload(files, "m", 2)))
        assert finish is Finish.ABORT and 10 <= len(tokens) < 80 and set(versions) == {1}
        with pytest.raises(NotFoundError, match="m v1"):
            await core.generate(request(PolicyRef("m", 1)))

    run(main)


@pytest.mark.parametrize("policy", ["finish", "continue"])
def test_adapter_update_policy_for_requests_following_latest(files: ModelFiles, adapter: dict, policy: str) -> None:
    async def main() -> None:
        core = make_core(files, update_policy=policy)
        await core.load(adapter_payload("a", 1, adapter))
        tokens, versions, finish = await stream_switching(
            core, request(PolicyRef("a"), max_tokens=60), 15, lambda: core.load(adapter_payload("a", 2, adapter)))
        assert finish is Finish.LENGTH and len(tokens) == 60
        if policy == "finish":
            assert versions == [1] * 60 and tokens == expected_tokens([], 60, "base+a-v1")
        else:
            k = versions.index(2)
            assert k >= 15 and versions == [1] * k + [2] * (60 - k)
            assert tokens[k:] == expected_tokens(tokens[:k], 60 - k, "base+a-v2")

    run(main)


def test_versions_beyond_the_window_are_unloaded_only_after_their_requests_finish(files: ModelFiles,
                                                                                   adapter: dict) -> None:
    async def main() -> None:
        engine = FakeEngine(files)
        core = make_core(files, engine, adapter_window=1, max_loras=2)
        await core.load(adapter_payload("a", 1, adapter))
        running = asyncio.ensure_future(core.generate(request(PolicyRef("a"), max_tokens=100)))
        while not engine.live:
            await asyncio.sleep(0.001)
        await core.load(adapter_payload("a", 2, adapter))
        assert "remove a-v1" not in engine.calls  # still generating
        with pytest.raises(NotFoundError, match="retiring"):
            await core.generate(request(PolicyRef("a", 1), request_id="late"))
        [result] = await running
        assert result.completions[0].versions == [1] * 100
        for _ in range(100):
            if "remove a-v1" in engine.calls:
                break
            await asyncio.sleep(0.01)
        assert "remove a-v1" in engine.calls and [v.version for v in core.table.all_versions()] == [2]

    run(main)


def test_queue_limit_and_duplicate_request_ids(files: ModelFiles) -> None:
    async def main() -> None:
        core = make_core(files, max_queued_requests=4)
        running = asyncio.ensure_future(core.generate(request(max_tokens=200, n=3, request_id="big")))
        await asyncio.sleep(0.02)
        with pytest.raises(ResourceExhaustedError, match="max_queued_requests"):
            await core.generate(request(n=2, request_id="more"))
        with pytest.raises(AlreadyExistsError):
            await core.generate(request(n=1, request_id="big"))
        # more than the limit in one request never fits: refused as a request to split, not to retry
        with pytest.raises(InvalidArgumentError, match="split it"):
            await core.generate(request(n=5, request_id="huge"))
        [small] = await core.generate(request(n=1, request_id="fits"))
        assert small.completions[0].finish is Finish.LENGTH
        assert await core.abort(["big"]) == 1
        [result] = await running
        assert all(c.finish is Finish.ABORT and len(c.token_ids) < 200 for c in result.completions)

    run(main)


def test_each_job_holds_at_most_its_token_quota_and_the_others_keep_their_room(files: ModelFiles, adapter: dict
                                                                              ) -> None:
    """rollout.max_job_tokens_in_flight: a job past its quota is refused (RESOURCE_EXHAUSTED, for it alone) while
    another job and the base model are still admitted; a request past the quota on its own is one to split."""
    per_sequence = len(PROMPT) + 200

    async def main() -> None:
        core = make_core(files, max_job_tokens_in_flight=2 * per_sequence)
        await core.load(adapter_payload("a", 1, adapter))
        await core.load(adapter_payload("b", 1, adapter))
        flood = asyncio.ensure_future(core.generate(request(PolicyRef("a"), max_tokens=200, n=2, request_id="a1")))
        await asyncio.sleep(0.02)
        assert core.runner.job_tokens("a") == 2 * per_sequence
        with pytest.raises(ResourceExhaustedError, match=r"job 'a' has \d+ tokens in flight.*max_job_tokens_in_fl"):
            await core.generate(request(PolicyRef("a"), max_tokens=8, request_id="a2"))
        [b] = await core.generate(request(PolicyRef("b"), max_tokens=8, request_id="b1"))  # b's room is its own
        [base] = await core.generate(request(BASE, max_tokens=8, request_id="base"))
        assert len(b.completions[0].token_ids) == len(base.completions[0].token_ids) == 8
        with pytest.raises(InvalidArgumentError, match="split it"):
            await core.generate(request(PolicyRef("b"), max_tokens=200, n=3, request_id="b-huge"))
        assert await core.abort(["a1"]) == 1
        await flood
        assert core.runner.job_tokens("a") == 0
        [again] = await core.generate(request(PolicyRef("a"), max_tokens=8, request_id="a3"))  # its room is back
        assert len(again.completions[0].token_ids) == 8

    run(main)


def test_failed_loads_keep_the_previous_version_serving(files: ModelFiles, adapter: dict) -> None:
    async def main() -> None:
        engine = FakeEngine(files, max_lora_rank=8)
        core = make_core(files, engine)
        await core.load(adapter_payload("a", 1, adapter))
        big_rank = random_adapter(files.root, rank=16)
        wrong_shape = {n: (t[:, :-1] if "lora_A" in n else t) for n, t in adapter.items()}
        bad_name = {"model.layers.0.q_proj.weight": next(iter(adapter.values()))}
        lone_half = {n: t for n, t in adapter.items() if "lora_A" in n}
        cases = [
            (adapter_payload("a", 2, adapter, fingerprint="sha256:other"), FailedPreconditionError, "base model"),
            (adapter_payload("a", 2, big_rank, LoraSpec(16, 32.0, ())), FailedPreconditionError, "max_lora_rank"),
            (adapter_payload("a", 2, wrong_shape), FailedPreconditionError, "do not fit"),
            (adapter_payload("a", 2, bad_name), InvalidArgumentError, "PEFT"),
            (adapter_payload("a", 2, lone_half), InvalidArgumentError, "missing"),
            (adapter_payload("a", 1, adapter), FailedPreconditionError, "not newer"),
            (merged_payload(files, "a", 2), FailedPreconditionError, "unload it"),
        ]
        for payload, error, text in cases:
            with pytest.raises(error, match=text):
                await core.load(payload)
        engine.fail_add_adapter = RuntimeError("engine says no")
        with pytest.raises(FailedPreconditionError, match="engine says no"):
            await core.load(adapter_payload("a", 2, adapter))
        assert core.active_versions() == {"a": 1}
        assert [h.name for h in engine.adapters.values()] == ["a-v1"]
        [result] = await core.generate(request(PolicyRef("a")))
        assert result.completions[0].versions == [1] * 8

    run(main)


def test_unknown_policies_and_engines_without_lora(files: ModelFiles, adapter: dict) -> None:
    async def main() -> None:
        core = make_core(files, FakeEngine(files, supports_lora=False))
        with pytest.raises(NotFoundError, match="nope"):
            await core.generate(request(PolicyRef("nope")))
        with pytest.raises(FailedPreconditionError, match="fake: no LoRA"):
            await core.load(adapter_payload("a", 1, adapter))
        await core.load(merged_payload(files, "m", 3))
        with pytest.raises(NotFoundError, match="servable versions: \\[3\\]"):
            await core.generate(request(PolicyRef("m", 2)))
        with pytest.raises(FailedPreconditionError, match="merged m v3"):
            await core.generate(request())
        await core.unload("m")
        [result] = await core.generate(request())
        assert result.completions[0].token_ids == expected_tokens([], 8, "base")

    run(main)


def test_local_merge_of_an_adapter_for_a_replica_without_lora(files: ModelFiles, adapter: dict) -> None:
    async def main() -> None:
        engine = FakeEngine(files, supports_lora=False)
        core = make_core(files, engine)
        payload = PolicyPayload("a", 1, Mode.ADAPTER, Mode.MERGED, "sha256:base", adapter, LORA)
        await core.stage(payload)
        [token] = engine.staged
        staged = engine.staged[token]
        assert sorted(staged) == files.weight_names()
        name = "model.layers.0.self_attn.q_proj.weight"
        a = adapter[f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"]
        b = adapter[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
        torch.testing.assert_close(staged[name], files.tensor(name) + b @ a * LORA.scale)
        torch.testing.assert_close(staged["model.norm.weight"], files.tensor("model.norm.weight"))
        await core.commit("a", 1)
        [result] = await core.generate(request(PolicyRef("a")))
        assert result.completions[0].versions == [1] * 8

    run(main)


def test_a_shared_engine_never_writes_its_base_and_says_why(files: ModelFiles, adapter: dict) -> None:
    """rollout.shared: several jobs sample from this engine, so neither an adapter merged locally nor merged
    weights is staged (the base every other job samples from stays as it was); adapters still are."""
    async def main() -> None:
        engine = FakeEngine(files, supports_lora=False)
        core = make_core(files, engine, shared=True)
        with pytest.raises(FailedPreconditionError, match=r"a v1 would replace this engine's base weights "
                                                          r"\(an adapter merged locally\).*serves adapters only"):
            await core.stage(PolicyPayload("a", 1, Mode.ADAPTER, Mode.MERGED, "sha256:base", adapter, LORA))
        with pytest.raises(FailedPreconditionError, match=r"\(merged weights\)"):
            await core.stage(merged_payload(files, "m", 1))
        assert engine.staged == {}
        lora_core = make_core(files, shared=True)
        await lora_core.load(adapter_payload("a", 1, adapter))
        assert [p.version for p in lora_core.status().policies if p.job_id == "a"] == [1]
        from lorarl.rollout.convert import capabilities

        assert capabilities(lora_core.info, lora_core.settings, "sha256:base").shared  # what clients are told

    run(main)


def test_pause_holds_generation_until_resume(files: ModelFiles) -> None:
    async def main() -> None:
        engine = FakeEngine(files)
        core = make_core(files, engine)
        await core.pause()
        running = asyncio.ensure_future(core.generate(request(max_tokens=5)))
        await asyncio.sleep(0.05)
        assert not running.done() and core.status().paused
        await core.resume()
        [result] = await asyncio.wait_for(running, 5)
        assert result.completions[0].finish is Finish.LENGTH

    run(main)


def test_stream_chunks_end_with_one_finish_per_completion(files: ModelFiles) -> None:
    async def main() -> None:
        core = make_core(files)
        chunks: list[CompletionChunk] = [c async for c in core.generate_stream(request(max_tokens=4, n=2))]
        for index in (0, 1):
            mine = [c for c in chunks if c.index == index]
            assert sum(len(c.token_ids) for c in mine) == 4
            assert [c.finish for c in mine if c.finish is not None] == [Finish.LENGTH]
            assert mine[-1].finish is Finish.LENGTH

    run(main)


def test_policy_sink_drives_the_core_from_a_worker_thread(files: ModelFiles, adapter: dict) -> None:
    from lorarl.rollout.sink import RolloutSink
    from lorarl.v1 import common_pb2
    from lorarl.weightsync.client.sinks import PolicySink, PolicyUpdate
    from lorarl.weightsync.wire.payload import build_manifest, pack

    async def main() -> None:
        core = make_core(files)
        sink = RolloutSink(core, asyncio.get_running_loop())
        assert isinstance(sink, PolicySink)
        buckets = list(pack(sorted(adapter.items())))
        manifest = build_manifest(job_id="a", version=1, mode=common_pb2.SYNC_MODE_ADAPTER,
                                  base_model_fingerprint="sha256:base", buckets=buckets,
                                  lora=common_pb2.LoraSpec(rank=8, alpha=16.0))
        update = PolicyUpdate(manifest, adapter, common_pb2.SYNC_MODE_ADAPTER)

        def agent() -> dict[str, int]:
            sink.stage(update)
            staged = sink.active_versions()
            sink.commit("a", 1)
            return {"staged": staged.get("a", 0), **sink.active_versions()}

        assert await asyncio.to_thread(agent) == {"staged": 0, "a": 1}
        with pytest.raises(RuntimeError, match="worker thread"):
            sink.active_versions()
        assert threading.current_thread() is threading.main_thread()

    run(main)
