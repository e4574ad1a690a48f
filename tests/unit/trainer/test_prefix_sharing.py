"""Shared-prompt forward (lorarl.trainer.engines.torch.prefix_sharing) gives the plain forward's logprobs, entropies,
LoRA gradients and whole train steps, on the shipped tiny dense and MoE Qwen3 checkpoints, with the
completion pass in padded rows and in packed lines."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorarl.assets.paths import DENSE_MODEL_DIR, MOE_MODEL_DIR
from lorarl.trainer.engines.api import TrajectoryRecord
from lorarl.trainer.engines.torch import prefix_sharing
from lorarl.trainer.engines.torch.engine import TorchEngine, completion_logprobs
from lorarl.trainer.engines.torch.prefix_sharing import (
    attention_cost,
    plan_prefix_sharing,
    shared_prefix_hidden,
    supports_prefix_sharing,
)
from lorarl.trainer.rl.batching import micro_batches, pack
from lorarl.trainer.rl.lora import LoraConfig, inject_lora, lora_parameters
from lorarl.trainer.rl.losses import LossSpec
from tests.unit.trainer.engine_utils import make_spec
from tests.unit.trainer.fp64 import fp64_logprobs, max_diff, spread_bound
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


def forward_backward(model: torch.nn.Module, records: list[TrajectoryRecord], share: bool,
                     packed: bool = True) -> Result:
    """(logp, entropy, LoRA grads) of a loss using both, so gradients flow through each."""
    for p in lora_parameters(model):
        p.grad = None
    batch = pack(records)
    logp, entropy = completion_logprobs(model, batch, entropy_grad=True, share_prompts=share,
                                        pack_completions=packed)
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


def assert_shared_equals_plain(path: Path, attn: str, records: list[TrajectoryRecord], packed: bool = False) -> None:
    """Exact at the decoder output of an fp64 model (hidden states to 1e-5 and their LoRA gradients to
    1e-6 relative: transformers still runs RMSNorm, and eager attention's softmax, in fp32, so rounding
    flips there are the floor; a wrong position or mask would be off by orders of magnitude more), and
    in fp32 end to end: logprobs and entropies to 1e-5, gradients as assert_close_to_exact says.
    ``packed``: the completion pass in packed lines (the layout the model's estimate picks, asserted)."""
    model = lora_model(path, attn, torch.float64)
    batch = pack(records)
    plan = plan_prefix_sharing(batch, attention_cost(model) if packed else None)
    assert plan is not None and plan.completions.packed == packed
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
    shared = forward_backward(model, records, share=True, packed=packed)
    plain = forward_backward(model, records, share=False)
    torch.testing.assert_close(shared[0], plain[0], rtol=1e-6, atol=TOL)  # every entry, padding included
    torch.testing.assert_close(shared[1], plain[1], rtol=1e-6, atol=TOL)
    assert_close_to_exact(shared[2], plain[2], exact)


def decoder_rows(model: torch.nn.Module, masks: list[int] | None = None
                 ) -> tuple[list[tuple[int, ...]], torch.utils.hooks.RemovableHandle]:
    """Records the input_ids shape of every decoder call (and, into ``masks``, its attention mask's ndim:
    4 only for a packed completion pass)."""
    shapes: list[tuple[int, ...]] = []

    def hook(_m: torch.nn.Module, _a: tuple, kw: dict) -> None:
        shapes.append(tuple(kw["input_ids"].shape))
        if masks is not None:
            masks.append(kw["attention_mask"].ndim)

    return shapes, model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)


def test_plan_groups_rows_by_prompt_and_declines_when_nothing_repeats() -> None:
    a, b = [5, 6, 7], [9]
    rec = [TrajectoryRecord(p, c, [], [], 0.0) for p, c in ((a, [1, 2]), (b, [3]), (a, [4, 4, 4]), (b, [8, 8]))]
    plan = plan_prefix_sharing(pack(rec))
    assert plan is not None and plan.prompts == 2
    assert plan.row_prompt.tolist() == [0, 1, 0, 1]
    assert plan.prompt_lengths.tolist() == [3, 1]
    assert plan.prompt_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert not plan.completions.packed and plan.completions.row_start.tolist() == [0, 2, 4, 6]  # T-1 = 2 per row
    assert plan_prefix_sharing(pack([rec[0], rec[1]])) is None  # distinct prompts
    assert plan_prefix_sharing(pack([rec[0]])) is None
    # A prompt that is a prefix of another is a different prompt.
    prefix = [TrajectoryRecord([5, 6], [7, 1], [], [], 0.0), TrajectoryRecord([5, 6, 7], [1], [], [], 0.0)]
    assert plan_prefix_sharing(pack(prefix)) is None


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_shared_forward_equals_plain_logprobs_entropy_and_lora_grads(which: str, attn: str, packed: bool) -> None:
    records = groups(1, n_groups=4, size=3, shuffle=True)  # group members not adjacent
    lengths = [len(r.completion_token_ids) for r in records]
    assert min(lengths) == 1 and lengths.count(max(lengths)) == 2  # 1-token rows, and rows as long as T (fill a line)
    assert len({len(r.prompt_token_ids) for r in records}) > 1
    model = lora_model(MODELS[which], attn)
    shapes, handle = decoder_rows(model)
    completion_logprobs(model, pack(records), share_prompts=False)
    assert shapes == [(12, max(r.num_tokens for r in records))]
    shapes.clear()
    completion_logprobs(model, pack(records), share_prompts=True, pack_completions=packed)
    handle.remove()
    padded_slots = 12 * (max(lengths) - 1)
    assert shapes[0][0] == 4  # 4 prompts once, then the completion pass:
    if packed:  # lines without the padding, every real input once
        assert sum(n - 1 for n in lengths) <= shapes[1][0] * shapes[1][1] < 0.8 * padded_slots
    else:  # 12 rows right-padded to T-1
        assert shapes[1] == (12, max(lengths) - 1)
    assert_shared_equals_plain(MODELS[which], attn, records, packed)


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
    loss = LossSpec(type="grpo", kl_coef=0.1, entropy_coef=0.01, behavior_weight_cap=2.0)
    budget = 40
    records = groups(2, n_groups=5, size=4)
    plan = micro_batches([r.num_tokens for r in records], budget)
    keys = [{records[i].group_id for i in idx} for idx in plan]
    assert len(plan) > 2 and any(len(a & b) for a, b in itertools.pairwise(keys))  # a group split across micro-batches
    assert any(len(k) < len(idx) for k, idx in zip(keys, plan, strict=True))  # and micro-batches that share
    engines = {}
    # plain, shared prompts with padded / packed completions, and "exact": plain in fp64, the gradients' reference
    for name in ("plain", "padded", "packed", "exact"):
        engine = TorchEngine(make_spec(MODELS[which], lr=1e-4, micro_batch_tokens=budget, loss=loss))
        engine.share_prompts = name in ("padded", "packed")
        engine.pack_completions = name == "packed"
        randomize_adapters(engine.model, std=0.02)
        engines[name] = engine.model.double() and engine if name == "exact" else engine
    timed = ("plain", "padded", "packed")
    masks: dict[str, list[int]] = {name: [] for name in timed}
    calls = {name: decoder_rows(engines[name].model, masks[name]) for name in timed}
    metrics = {name: e.forward_backward(records) for name, e in engines.items()}
    grads = {name: [p.grad for p in e.named_trainable_parameters().values()] for name, e in engines.items()}
    for name in ("padded", "packed"):
        assert_close_to_exact(grads[name], grads["plain"], grads["exact"])
    for name in timed:
        metrics[name].update(engines[name].optim_step())
        metrics[name].update(engines[name].train_step(records))
    compared = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "grad_norm")
    for name, key in itertools.product(("padded", "packed"), compared):
        assert metrics[name][key] == pytest.approx(metrics["plain"][key], rel=TOL, abs=TOL), (name, key)
    assert metrics["packed"]["kl"] > 0
    slots = {name: sum(rows * width for rows, width in shapes) for name, (shapes, _) in calls.items()}
    assert slots["padded"] < 0.8 * slots["plain"]  # the shared path really ran, on fewer token slots
    assert slots["packed"] < slots["padded"]  # and packing skipped padding on top
    assert 4 in masks["packed"] and 4 not in masks["padded"]  # packed completion passes (4D masks) ran
    plain = engines["plain"].named_trainable_parameters()
    start = engines["exact"].named_trainable_parameters()  # never stepped
    assert max((p - start[n]).abs().max().item() for n, p in plain.items()) > 1e-4  # the steps did update
    # AdamW divides each gradient element by its own magnitude, so an element whose gradient sits at
    # fp32 rounding level moves by a rounding-driven fraction of lr (both paths alike): measured up to
    # 6e-5 at lr 1e-3 on the MoE model, hence lr 1e-4 for this comparison (and 1.01e-5 at lr 1e-4 on
    # another host's CPU kernels: the bound is 3e-5, under a third of one step's lr).
    for name in ("padded", "packed"):
        shared = engines[name].named_trainable_parameters()
        for param, p in plain.items():
            torch.testing.assert_close(shared[param], p, rtol=0, atol=3e-5,
                                       msg=f"{name} {param}: {(shared[param] - p).abs().max().item():.2e}")
        for ref in (False, True):
            got = engines[name].compute_logprobs(records, reference=ref)
            want = engines["plain"].compute_logprobs(records, reference=ref)
            # Bound from the plain path's own fp32 error against its float64 twin (tests/unit/trainer/fp64.py):
            # logprobs near -20 carry ~1e-5 of fp32 rounding either way, so a fixed 1e-5 failed now and then.
            bound = spread_bound(want, fp64_logprobs(engines["plain"], records, reference=ref))
            assert max_diff(got, want) <= bound, (name, ref, max_diff(got, want), bound)


def test_packed_lines_hold_one_groups_rows_end_to_end_at_their_true_positions() -> None:
    a, b = [5, 6, 7], [9]  # prompts of 3 and 1 tokens
    shapes = [(a, [11, 12, 13, 14]), (a, [21]), (a, [31, 32, 33]), (b, [41, 42, 43, 44]), (a, [51, 52]),
              (b, [61, 62, 63, 64])]
    records = [TrajectoryRecord(p, c, [], [], 0.0) for p, c in shapes]
    batch = pack(records)  # T = 4: padded rows would be 6 x 3 slots
    plan = plan_prefix_sharing(batch, attention_weight=1e-3)
    assert plan is not None
    layout = plan.completions
    # Row inputs (widest first, first fit in lines of T-1 = 3): [11 12 13] [31 32 51] [41 42 43] [61 62 63];
    # the 1-token row has no input; lines never mix the two prompts.
    assert layout.packed and (layout.lines, layout.width) == (4, 3)
    assert layout.line_prompt.tolist() == [0, 0, 1, 1]
    assert layout.row_start.tolist() == [0, 0, 3, 6, 5, 9]
    model = lora_model(DENSE_MODEL_DIR, "sdpa")
    seen: list[dict] = []
    handle = model.get_decoder().register_forward_pre_hook(lambda _m, _a, kw: seen.append(dict(kw)), with_kwargs=True)
    shared_prefix_hidden(model.get_decoder(), batch, plan)
    handle.remove()
    call = seen[1]
    assert call["input_ids"].tolist() == [[11, 12, 13], [31, 32, 51], [41, 42, 43], [61, 62, 63]]
    assert call["position_ids"].tolist() == [[3, 4, 5], [3, 4, 3], [1, 2, 3], [1, 2, 3]]
    mask = call["attention_mask"]
    assert mask.shape == (4, 1, 3, 3 + 3) and mask.dtype == torch.bool
    # Line 1: 31 32 | 51 — each sees prompt a's 3 keys, and only its own row's inputs, causally.
    assert mask[1, 0].int().tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]]
    # Line 2 continues prompt b (1 real token of Pmax 3).
    assert mask[2, 0, 2].int().tolist() == [1, 0, 0, 1, 1, 1]
    assert_shared_equals_plain(DENSE_MODEL_DIR, "sdpa", records, packed=True)


def test_packing_falls_back_to_padded_rows_over_the_mask_cap_or_when_nothing_is_padding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # One group: a 5-token completion and seven of 4 (inputs: 4 and 3 x 7). Lines of T-1 = 4 slots fit one row
    # each (no saving); only wider lines save slots, and their masks outgrow the padded rows' 8 x 4 x (1 + 4).
    rng = random.Random(3)
    records = [TrajectoryRecord([9], [rng.randrange(1, 250) for _ in range(n)], [], [], 0.0, "g")
               for n in (4, 4, 5, 4, 4, 4, 4, 4)]
    model = lora_model(DENSE_MODEL_DIR, "sdpa")
    weight = attention_cost(model)
    packed = plan_prefix_sharing(pack(records), weight)
    assert packed is not None and packed.completions.packed
    assert (packed.completions.lines, packed.completions.width) == (1, 25)  # one line: 25 inputs, no padding
    assert_shared_equals_plain(DENSE_MODEL_DIR, "sdpa", records, packed=True)
    monkeypatch.setattr(prefix_sharing, "MAX_MASK_ELEMENTS", 8 * 4 * 5)  # no more than the padded rows' mask
    plan = plan_prefix_sharing(pack(records), weight)
    assert plan is not None and not plan.completions.packed
    shapes, handle = decoder_rows(model)
    shared = forward_backward(model, records, share=True)
    handle.remove()
    assert shapes == [(1, 1), (8, 4)]  # the prompt, then the padded rows
    plain = forward_backward(model, records, share=False)
    torch.testing.assert_close(shared[0], plain[0], rtol=1e-6, atol=TOL)
    monkeypatch.undo()
    # Equal completion lengths: no padding to skip, so no packing (it would only add a mask).
    groups_of_three = groups(1, n_groups=4, size=3)
    even = [TrajectoryRecord(r.prompt_token_ids, [7, 8, 9], [], [], 0.0, r.group_id) for r in groups_of_three]
    plan = plan_prefix_sharing(pack(even), weight)
    assert plan is not None and not plan.completions.packed
    # An attention implementation without explicit 4D masks keeps padded rows.
    model.config._attn_implementation = "flash_attention_2"
    assert attention_cost(model) is None


def test_packed_layout_skips_most_padding_on_a_demo_shaped_batch() -> None:
    """16 prompts of 14-18 tokens x 8 completions of 1-8 tokens (the demo stops early at EOS)."""
    rng = random.Random(0)
    records = []
    for g in range(16):
        prompt = [rng.randrange(1, 250) for _ in range(rng.randint(14, 18))]
        for _ in range(8):
            n = rng.randint(1, 8)
            records.append(TrajectoryRecord(prompt, [rng.randrange(1, 250) for _ in range(n)], [], [], 0.0, f"g{g}"))
    model = lora_model(DENSE_MODEL_DIR, "sdpa")
    batch = pack(records)
    padded = plan_prefix_sharing(batch)
    plan = plan_prefix_sharing(batch, attention_cost(model))
    assert padded is not None and plan is not None and plan.completions.packed
    real = sum(len(r.completion_token_ids) - 1 for r in records)
    assert padded.completions.slots == 128 * 7 and real < 0.6 * padded.completions.slots  # padded rows: >40% padding
    # Packed lines: under 20% padding (lines of one group leave gaps: 469 slots for 403 inputs here).
    assert real <= plan.completions.slots < 1.2 * real
    slots = {}
    for packed in (False, True):
        shapes, handle = decoder_rows(model)
        completion_logprobs(model, batch, pack_completions=packed)
        handle.remove()
        slots[packed] = sum(rows * width for rows, width in shapes)
    assert slots[True] < 0.75 * slots[False]  # every decoder token slot, the prompt pass included
