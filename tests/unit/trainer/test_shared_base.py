"""Many jobs, one base: torch-engine jobs on one model share its resident copy and stay apart.

Each job owns its adapter (rank, alpha, targets, experts), optimizer, step counter and RNG; the base is
loaded once. A job's results beside others — one of them failing, then deleted — are bit-identical to the
same job alone at the same seed (issue #31's isolation rule).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.engines.torch.shared_base import BaseRegistry
from lorarl.trainer.rl.lora import LoraConfig, lora_modules
from lorarl.trainer.rl.losses import LossSpec
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch

# B trains with dropout, so its RNG stream is part of what must not move when A computes between its steps.
B_LORA = LoraConfig(rank=4, alpha=8, dropout=0.1)
A_LORA = LoraConfig(rank=8, alpha=8, target_modules=("q_proj", "v_proj"))


def run_b(engine: TorchEngine, steps: int, between=lambda step: None) -> list[dict[str, float]]:
    out = []
    for step in range(steps):
        out.append(engine.train_step(synthetic_batch(seed=step, version=engine.version)))
        between(step)
    return out


def adapter(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.iter_adapter_tensors()}


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_a_job_beside_a_failing_job_on_its_base_gives_what_it_gives_alone(model: str, dense_dir: Path,
                                                                          moe_dir: Path) -> None:
    path = dense_dir if model == "dense" else moe_dir
    alone = TorchEngine(make_spec(path, lora=B_LORA, seed=3))
    expected = run_b(alone, 3)
    expected_adapter, expected_logprobs = adapter(alone), alone.compute_logprobs(synthetic_batch(seed=9))
    alone.close()

    bases = BaseRegistry()
    b = TorchEngine(make_spec(path, lora=B_LORA, seed=3), bases=bases)
    a = TorchEngine(make_spec(path, lora=A_LORA, seed=11, loss=LossSpec(kl_coef=0.05)), bases=bases)
    assert a.model is b.model and len(bases) == 1 and a.resident_base and not b.resident_base

    def a_works_then_fails(step: int) -> None:
        a.train_step(synthetic_batch(seed=100 + step, version=a.version))
        if step == 1:  # A's own bad inputs: a NaN reward (its step is skipped), then a token past the vocabulary
            nan = synthetic_batch(seed=7, version=a.version)
            nan[0].reward = math.nan
            assert a.train_step(nan)["skipped"] == 1.0
            bad = synthetic_batch(seed=8, version=a.version)
            bad[0].completion_token_ids[0] = 10**6
            with pytest.raises(IndexError):
                a.train_step(bad)
            a.close()  # deleted mid-run

    got = run_b(b, 3, between=lambda step: a_works_then_fails(step) if step < 2 else None)
    for want, have in zip(expected, got, strict=True):
        assert {k: v for k, v in want.items() if k != "time_s"} == {k: v for k, v in have.items() if k != "time_s"}
    have_adapter = adapter(b)
    assert have_adapter.keys() == expected_adapter.keys()
    assert all(torch.equal(have_adapter[k], expected_adapter[k]) for k in have_adapter)
    assert b.compute_logprobs(synthetic_batch(seed=9)) == expected_logprobs
    b.close()
    assert len(bases) == 0  # the base went with its last job


def test_jobs_on_one_base_hold_one_copy_of_it_and_their_own_adapters(dense_dir: Path) -> None:
    bases = BaseRegistry()
    first = TorchEngine(make_spec(dense_dir, lora=LoraConfig(rank=4, alpha=8), seed=1), bases=bases)
    base_bytes = first.base.base_bytes
    second = TorchEngine(make_spec(dense_dir, lora=A_LORA, seed=2), bases=bases)
    assert first.base is second.base and first.base.base_bytes == base_bytes  # adding a job adds no base bytes
    weights = {id(p) for p in first.model.parameters() if not p.requires_grad}
    assert weights and all(not p.requires_grad for p in second.model.parameters() if id(p) in weights)
    # Each job's adapter is its own: ranks and targets differ, and neither job's parameters are the other's.
    a, b = adapter(first), adapter(second)
    assert {k.rsplit(".", 3)[-3] for k in b} == {"q_proj", "v_proj"} and len(a) > len(b)
    assert not {id(p) for p in first.named_trainable_parameters().values()} \
        & {id(p) for p in second.named_trainable_parameters().values()}
    assert first.trainable_parameters != second.trainable_parameters
    # Training one moves only its own adapter, and its merged export carries only its own update.
    second.train_step(synthetic_batch(seed=0))
    assert all(torch.equal(v, a[k]) for k, v in adapter(first).items())
    assert not all(torch.equal(v, b[k]) for k, v in adapter(second).items())
    merged_first = dict(first.iter_merged_tensors())
    base = dict(first.iter_base_tensors())
    q = next(k for k in merged_first if k.endswith("q_proj.weight"))
    assert torch.equal(merged_first[q], base[q])  # first's B is still zero: its merge is the base
    assert not torch.equal(dict(second.iter_merged_tensors())[q], base[q])
    first.close()
    attached = {name for name, _ in lora_modules(second.model)}
    assert len(bases) == 1 and attached and attached <= set(second.slot.adapters)  # none of first's is left
    second.close()
    assert len(bases) == 0


def test_a_different_dtype_or_a_full_fine_tune_gets_a_base_of_its_own(dense_dir: Path) -> None:
    bases = BaseRegistry()
    fp32 = TorchEngine(make_spec(dense_dir, seed=1), bases=bases)
    bf16 = TorchEngine(make_spec(dense_dir, seed=1, dtype="bfloat16"), bases=bases)
    full = TorchEngine(make_spec(dense_dir, seed=1, full_finetune=True), bases=bases)
    assert fp32.model is not bf16.model and full.model not in (fp32.model, bf16.model) and len(bases) == 2
    for engine in (fp32, bf16, full):
        engine.close()
    assert len(bases) == 0


def test_jobs_on_one_base_get_compute_turns_in_proportion_to_their_shares(dense_dir: Path) -> None:
    """Two jobs on one base, share 3 and 1, each with calls always waiting: while both wait, the first takes
    about three turns for each of the second's (JobManager's weighted fair share at the base)."""
    import asyncio

    from lorarl.trainer.service.jobs import JobManager

    async def main() -> list[str]:
        manager = JobManager()
        for job_id, share in (("heavy", 3.0), ("light", 1.0)):
            await manager.create(job_id, make_spec(dense_dir, lora=B_LORA, share=share))
        batch = synthetic_batch(seed=1, groups=4, group_size=4)
        done: list[str] = []

        async def caller(job_id: str, calls: int) -> None:
            for _ in range(calls):
                await manager.compute_logprobs(job_id, batch, reference=False)
                done.append(job_id)

        await asyncio.gather(*(caller(job_id, 8) for job_id in ("heavy", "light") for _ in range(3)))
        return done

    done = asyncio.run(main())
    first = done[:20]  # both have calls waiting throughout: about 15 of heavy's to 5 of light's
    assert 13 <= first.count("heavy") <= 17, done
