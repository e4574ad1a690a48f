"""Shared-prompt forward (services.trainer.prefix_sharing) gives the plain forward's logprobs, entropies,
LoRA gradients and whole train steps, on the shipped tiny dense and MoE Qwen3 checkpoints."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from assets.paths import DENSE_MODEL_DIR, MOE_MODEL_DIR
from services.trainer.batching import micro_batches, pack
from services.trainer.engine_api import TrajectoryRecord
from services.trainer.lora import LoraConfig, inject_lora, lora_parameters
from services.trainer.losses import LossSettings
from services.trainer.prefix_sharing import plan_prefix_sharing, shared_prefix_hidden, supports_prefix_sharing
from services.trainer.torch_engine import TorchEngine, completion_logprobs
from tests.unit.trainer.engine_utils import make_spec
from tests.unit.trainer.tiny import randomize_adapters

MODELS = {"dense": DENSE_MODEL_DIR, "moe": MOE_MODEL_DIR}
TOL = 1e-5


def groups(seed: int, n_groups: int = 4, size: int = 3, shuffle: bool = False) -> list[TrajectoryRecord]:
    """GRPO groups with prompts of 1-12 tokens and completions of 1-9 (vocab of the shipped models)."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, 250) for _ in range(rng.randint(1, 12))]
        for k in range(size):
            n = 1 if g == k == 0 else rng.randint(1, 9)
            out.append(TrajectoryRecord(prompt, [rng.randrange(1, 250) for _ in range(n)],
                                        [-rng.uniform(1.0, 6.0) for _ in range(n)], [0] * n,
                                        float(rng.randint(0, 3)), f"g{seed}-{g}"))
    if shuffle:
        rng.shuffle(out)
    return out


def lora_model(path: Path, attn: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    inject_lora(model, LoraConfig(rank=4, alpha=8))
    randomize_adapters(model, std=0.02)  # B != 0, so every LoRA parameter gets a gradient
    return model.to(dtype).train()


Result = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]


def forward_backward(model: torch.nn.Module, records: list[TrajectoryRecord], share: bool) -> Result:
    """(logp, entropy, LoRA grads) of a loss using both, so gradients flow through each."""
    for p in lora_parameters(model):
        p.grad = None
    batch = pack(records)
    logp, entropy = completion_logprobs(model, batch, entropy_grad=True, share_prompts=share)
    ((logp * batch.mask).sum() + 0.1 * (entropy * batch.mask).sum()).backward()
    return logp.detach(), entropy.detach(), [p.grad.clone() for p in lora_parameters(model)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_close_to_exact(shared: list[torch.Tensor], plain: list[torch.Tensor], exact: list[torch.Tensor]) -> None:
    """fp32 LoRA gradients: each within 1e-5 relative of the plain path's, or, where fp32 rounding alone
    exceeds that (q/k gradients cancel through the softmax: the plain fp32 path is itself up to ~1e-4 off
    the fp64 gradient), of the same order: within 4x the plain path's worst such error (measured up to 2.4x
    on single parameters, both ways, over random batches; shared is no less accurate overall)."""
    floor = 4 * max(rel(p, e) for p, e in zip(plain, exact, strict=True))
    for got, want, truth in zip(shared, plain, exact, strict=True):
        assert want.norm() > 1e-6
        assert rel(got, want) <= TOL or rel(got, truth) <= floor, (rel(got, want), rel(got, truth), floor)


def assert_shared_equals_plain(path: Path, attn: str, records: list[TrajectoryRecord]) -> None:
    """Exact at the decoder output of an fp64 model (hidden states to 1e-5 and their LoRA gradients to
    1e-6 relative: transformers still runs RMSNorm, and eager attention's softmax, in fp32, so rounding
    flips there are the floor; a wrong position or mask would be off by orders of magnitude more), and
    in fp32 end to end: logprobs and entropies to 1e-5, gradients as assert_close_to_exact says."""
    model = lora_model(path, attn, torch.float64)
    batch = pack(records)
    plan = plan_prefix_sharing(batch)
    assert plan is not None
    weight = torch.randn((*batch.completion_ids.shape, model.config.hidden_size), dtype=torch.float64,
                         generator=torch.Generator().manual_seed(0))
    hidden = {}
    for share in (False, True):
        for p in lora_parameters(model):
            p.grad = None
        if share:
            out = shared_prefix_hidden(model.get_decoder(), batch, plan)
        else:
            full = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            out = full.gather(1, batch.target_positions.unsqueeze(-1).expand(-1, -1, full.shape[-1]))
        (out * weight).sum().backward()
        hidden[share] = (out.detach(), [p.grad.clone() for p in lora_parameters(model)])
    torch.testing.assert_close(hidden[True][0], hidden[False][0], rtol=0, atol=TOL)
    for got, want in zip(hidden[True][1], hidden[False][1], strict=True):
        assert want.norm() > 1e-6 and rel(got, want) < 1e-6
    exact = forward_backward(model, records, share=False)[2]
    model = lora_model(path, attn)
    shared, plain = forward_backward(model, records, share=True), forward_backward(model, records, share=False)
    torch.testing.assert_close(shared[0], plain[0], rtol=1e-6, atol=TOL)  # every entry, padding included
    torch.testing.assert_close(shared[1], plain[1], rtol=1e-6, atol=TOL)
    assert_close_to_exact(shared[2], plain[2], exact)


def decoder_rows(model: torch.nn.Module) -> tuple[list[tuple[int, ...]], torch.utils.hooks.RemovableHandle]:
    """Records the input_ids shape of every decoder call."""
    shapes: list[tuple[int, ...]] = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    return shapes, handle


def test_plan_groups_rows_by_prompt_and_declines_when_nothing_repeats() -> None:
    a, b = [5, 6, 7], [9]
    rec = [TrajectoryRecord(p, c, [], [], 0.0) for p, c in ((a, [1, 2]), (b, [3]), (a, [4, 4, 4]), (b, [8, 8]))]
    plan = plan_prefix_sharing(pack(rec))
    assert plan is not None and plan.prompts == 2
    assert plan.row_prompt.tolist() == [0, 1, 0, 1]
    assert plan.prompt_lengths.tolist() == [3, 1]
    assert plan.prompt_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert plan_prefix_sharing(pack([rec[0], rec[1]])) is None  # distinct prompts
    assert plan_prefix_sharing(pack([rec[0]])) is None
    # A prompt that is a prefix of another is a different prompt.
    prefix = [TrajectoryRecord([5, 6], [7, 1], [], [], 0.0), TrajectoryRecord([5, 6, 7], [1], [], [], 0.0)]
    assert plan_prefix_sharing(pack(prefix)) is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_shared_forward_equals_plain_logprobs_entropy_and_lora_grads(which: str, attn: str) -> None:
    records = groups(1, n_groups=4, size=3, shuffle=True)  # group members not adjacent
    assert min(len(r.completion_token_ids) for r in records) == 1
    assert len({len(r.prompt_token_ids) for r in records}) > 1
    model = lora_model(MODELS[which], attn)
    shapes, handle = decoder_rows(model)
    completion_logprobs(model, pack(records), share_prompts=False)
    assert shapes == [(12, max(r.num_tokens for r in records))]
    shapes.clear()
    completion_logprobs(model, pack(records), share_prompts=True)
    handle.remove()
    assert [s[0] for s in shapes] == [4, 12]  # 4 prompts once, then 12 completions
    assert_shared_equals_plain(MODELS[which], attn, records)


def test_one_token_completions_need_no_completion_pass() -> None:
    records = [TrajectoryRecord([3, 4, 5], [c], [], [], 0.0, "g") for c in (7, 8, 9)]
    model = lora_model(DENSE_MODEL_DIR, "sdpa")
    shapes, handle = decoder_rows(model)
    completion_logprobs(model, pack(records), share_prompts=True)
    handle.remove()
    assert shapes == [(1, 3)]
    assert_shared_equals_plain(DENSE_MODEL_DIR, "sdpa", records)


def test_falls_back_to_the_plain_forward_when_no_prompt_repeats() -> None:
    model = lora_model(DENSE_MODEL_DIR, "sdpa")
    records = [TrajectoryRecord([3, 4 + i], [7, 8, 9], [], [], 0.0) for i in range(3)]
    shapes, handle = decoder_rows(model)
    completion_logprobs(model, pack(records), share_prompts=True)
    handle.remove()
    assert shapes == [(3, 5)]


def test_only_full_attention_qwen3_decoders_share() -> None:
    from tests.unit.trainer.qwen3_5_tiny import tiny_qwen3_5_model

    assert supports_prefix_sharing(AutoModelForCausalLM.from_pretrained(DENSE_MODEL_DIR))
    assert supports_prefix_sharing(AutoModelForCausalLM.from_pretrained(MOE_MODEL_DIR))
    assert not supports_prefix_sharing(tiny_qwen3_5_model())  # linear-attention layers cache a state


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_train_steps_with_split_groups_equal_the_plain_engine(which: str) -> None:
    # KL (reference pass), decoupled PPO (proximal pass) and an entropy bonus: every forward the step runs.
    loss = LossSettings(name="grpo", kl_coef=0.1, entropy_coef=0.01, behavior_weight_cap=2.0)
    budget = 40
    records = groups(2, n_groups=5, size=4)
    plan = micro_batches([r.num_tokens for r in records], budget)
    keys = [{records[i].group_id for i in idx} for idx in plan]
    assert len(plan) > 2 and any(len(a & b) for a, b in itertools.pairwise(keys))  # a group split across micro-batches
    assert any(len(k) < len(idx) for k, idx in zip(keys, plan, strict=True))  # and micro-batches that share
    engines = {}
    for share in (False, True, None):  # None: the plain path in fp64, the reference for gradients
        engine = TorchEngine(make_spec(MODELS[which], lr=1e-4, micro_batch_tokens=budget, loss=loss))
        engine.share_prompts = bool(share)
        randomize_adapters(engine.model, std=0.02)
        engines[share] = engine.model.double() and engine if share is None else engine
    calls = {share: decoder_rows(engines[share].model) for share in (False, True)}
    metrics = {share: e.forward_backward(records) for share, e in engines.items()}
    grads = {share: [p.grad for p in e.named_trainable_parameters().values()] for share, e in engines.items()}
    assert_close_to_exact(grads[True], grads[False], grads[None])
    for share in (False, True):
        metrics[share].update(engines[share].optim_step())
        metrics[share].update(engines[share].train_step(records))
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "grad_norm"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=TOL, abs=TOL), key
    assert metrics[True]["kl"] > 0
    slots = {share: sum(rows * width for rows, width in shapes) for share, (shapes, _) in calls.items()}
    assert slots[True] < 0.8 * slots[False]  # the shared path really ran, on fewer token slots
    plain, shared = engines[False].named_trainable_parameters(), engines[True].named_trainable_parameters()
    start = engines[None].named_trainable_parameters()  # never stepped
    assert max((p - start[n]).abs().max().item() for n, p in plain.items()) > 1e-4  # the steps did update
    # AdamW divides each gradient element by its own magnitude, so an element whose gradient sits at
    # fp32 rounding level moves by a rounding-driven fraction of lr (both paths alike): measured up to
    # 6e-5 at lr 1e-3 on the MoE model, hence lr 1e-4 for this comparison.
    for name, p in plain.items():
        torch.testing.assert_close(shared[name], p, rtol=0, atol=TOL, msg=name)
    for ref in (False, True):
        got = engines[True].compute_logprobs(records, reference=ref)
        want = engines[False].compute_logprobs(records, reference=ref)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=TOL)
