"""LoRA injection: frozen base, reference = adapters off, merged == adapter, PEFT round trip."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorarl.trainer.engines.export import save_merged_model, save_peft_adapter
from lorarl.trainer.rl.lora import (
    LoraConfig,
    LoRAExperts,
    LoRALinear,
    adapters_disabled,
    inject_lora,
    iter_merged_weights,
    load_peft_state_dict,
    lora_parameters,
    peft_state_dict,
)
from tests.unit.trainer.tiny import dense_model, moe_model, randomize_adapters

IDS = torch.tensor([[1, 5, 9, 13, 20, 33, 40, 2]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_all_linear_wraps_every_projection_and_experts() -> None:
    model = moe_model()
    names = inject_lora(model, LoraConfig(rank=4, alpha=8))
    assert sum(isinstance(model.get_submodule(n), LoRALinear) for n in names) == 2 * 4  # q,k,v,o per layer
    assert sum(isinstance(model.get_submodule(n), LoRAExperts) for n in names) == 2
    assert not any(n.endswith("lm_head") or n.endswith("mlp.gate") for n in names)


def test_target_modules_by_name_and_rejects_unknown() -> None:
    model = dense_model()
    names = inject_lora(model, LoraConfig(rank=2, target_modules=("q_proj", "v_proj")))
    assert sorted({n.rsplit(".", 1)[1] for n in names}) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="unknown names"):
        LoraConfig(target_modules=("qkv",))


def test_fresh_adapter_is_identity_and_base_is_frozen() -> None:
    base = logits(dense_model())
    model = dense_model()
    inject_lora(model, LoraConfig(rank=4))
    torch.testing.assert_close(logits(model), base, rtol=0, atol=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(model)}


def test_only_adapters_get_gradients_and_optimizer_state() -> None:
    model = moe_model()
    inject_lora(model, LoraConfig(rank=4, expert_mode="per_expert"))
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    model.train()
    out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    opt.step()
    lora_ids = {id(p) for p in lora_parameters(model)}
    for name, p in model.named_parameters():
        if id(p) in lora_ids:
            continue
        assert p.grad is None, f"base weight {name} got a gradient"
    assert set(opt.state.keys()) <= set(lora_parameters(model))
    b_grads = [p.grad for n, p in model.named_parameters() if "lora_b" in n]
    assert all(g is not None for g in b_grads) and any(g.abs().sum() > 0 for g in b_grads)


def test_reference_policy_is_base_with_adapters_off() -> None:
    base = logits(dense_model())
    model = dense_model()
    inject_lora(model, LoraConfig(rank=4))
    randomize_adapters(model)
    adapted = logits(model)
    assert (adapted - base).abs().max() > 1e-3
    with adapters_disabled(model):
        torch.testing.assert_close(logits(model), base, rtol=0, atol=0)
    torch.testing.assert_close(logits(model), adapted, rtol=0, atol=0)


def test_rslora_scale() -> None:
    assert LoraConfig(rank=16, alpha=32).scale == 2.0
    assert LoraConfig(rank=16, alpha=32, use_rslora=True).scale == 8.0


@pytest.mark.parametrize("expert_mode", ["per_expert", "shared"])
def test_merged_moe_checkpoint_equals_adapter_model(tmp_path: Path, expert_mode: str) -> None:
    model = moe_model()
    base_dir = tmp_path / "base"
    model.save_pretrained(base_dir)
    inject_lora(model, LoraConfig(rank=4, alpha=8, expert_mode=expert_mode))
    randomize_adapters(model)
    adapted = logits(model)
    out = save_merged_model(model, base_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(merged), adapted, rtol=0, atol=1e-4)
    # The trained base is untouched: its weights are bit-identical to the saved base.
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    fresh = dict(iter_merged_weights(base))
    for name, tensor in iter_merged_weights(model, merge=False):
        assert torch.equal(tensor, fresh[name]), name


def test_merged_dense_stream_uses_hf_names(tmp_path: Path) -> None:
    model = dense_model()
    hf_names = set(model.state_dict().keys()) - {"lm_head.weight"}
    inject_lora(model, LoraConfig(rank=4))
    randomize_adapters(model)
    streamed = [name for name, _ in iter_merged_weights(model)]
    assert len(streamed) == len(set(streamed))
    assert set(streamed) == hf_names


def test_peft_export_loads_in_peft_with_equal_logits(tmp_path: Path) -> None:
    from peft import PeftModel

    model = dense_model()
    base_dir = tmp_path / "base"
    model.save_pretrained(base_dir)
    lora = LoraConfig(rank=4, alpha=8)
    inject_lora(model, lora)
    randomize_adapters(model)
    adapter_dir = save_peft_adapter(model, lora, str(base_dir), tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    torch.testing.assert_close(logits(peft_model), logits(model), rtol=0, atol=1e-4)


def test_peft_state_dict_round_trip_and_mismatch() -> None:
    src = moe_model()
    inject_lora(src, LoraConfig(rank=4))
    randomize_adapters(src)
    dst = moe_model()
    inject_lora(dst, LoraConfig(rank=4))
    load_peft_state_dict(dst, peft_state_dict(src))
    torch.testing.assert_close(logits(dst), logits(src), rtol=0, atol=0)
    other = moe_model()
    inject_lora(other, LoraConfig(rank=8))
    with pytest.raises(ValueError, match="shape"):
        load_peft_state_dict(other, peft_state_dict(src))


def _lora_linear(dtype: torch.dtype = torch.float32, dropout: float = 0.0, bias: bool = True) -> LoRALinear:
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 40, bias=bias).to(dtype)
    layer = LoRALinear(base, rank=4, scale=2.0, dropout=dropout, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.lora_b.normal_(0, 0.1)  # a trained adapter: B = 0 would hide the update path
    return layer


def _low_rank_path(layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    """The textbook LoRA forward, written out: base + scale * (x A^T) B^T."""
    a, b = layer.lora_a.to(x.dtype), layer.lora_b.to(x.dtype)
    return torch.nn.functional.linear(x, layer.weight, layer.bias) + (x @ a.t() @ b.t()) * layer.scale


@pytest.mark.parametrize("shape,x_grad", [((7, 24), True), ((3, 5, 24), True), ((3, 5, 24), False)])
def test_fp32_forward_with_the_merged_weight_gives_the_low_rank_paths_outputs_and_gradients(
        shape: tuple[int, ...], x_grad: bool) -> None:
    layer = _lora_linear()
    assert layer._merged_matmul_applies(torch.zeros(shape))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), requires_grad=x_grad)
    up = torch.randn(*shape[:-1], 40, generator=torch.Generator().manual_seed(3))
    grads = {}
    for name, forward in (("merged", layer), ("low rank", lambda t: _low_rank_path(layer, t))):
        layer.zero_grad()
        xi = x.detach().clone().requires_grad_(x_grad)
        out = forward(xi)
        (out * up).sum().backward()
        grads[name] = (out.detach(), layer.lora_a.grad.clone(), layer.lora_b.grad.clone(),
                       xi.grad.clone() if x_grad else None)
    for got, want in zip(grads["merged"], grads["low rank"], strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert layer.weight.grad is None and layer.bias.grad is None  # the base stays frozen


@pytest.mark.parametrize("case", ["bf16", "dropout", "autocast"])
def test_the_low_rank_path_runs_where_a_merged_weight_would_change_the_result(case: str) -> None:
    """bf16 would round the small update into the weight, dropout must reach the update only, and
    autocast runs the base in bf16: each keeps the textbook path, bit for bit."""
    layer = _lora_linear(torch.bfloat16 if case == "bf16" else torch.float32, dropout=0.5 if case == "dropout" else 0.0)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(2)).to(layer.weight.dtype)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else contextlib.nullcontext()
    with context:
        assert not layer._merged_matmul_applies(x)
        torch.manual_seed(4)
        got = layer(x)
        torch.manual_seed(4)
        a, b = layer.lora_a.to(x.dtype), layer.lora_b.to(x.dtype)
        base = torch.nn.functional.linear(x, layer.weight, layer.bias)
        want = base + (torch.nn.functional.linear(torch.nn.functional.linear(layer.dropout(x), a), b)
                       * layer.scale).to(base.dtype)
    assert torch.equal(got, want)
