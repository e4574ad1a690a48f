"""LoRA injection: frozen base, reference = adapters off, merged == adapter, PEFT round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.trainer.export import save_merged_model, save_peft_adapter
from services.trainer.lora import (
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
