"""Megatron adapter exports: the torch engine's PEFT names and shapes, logits equal in transformers + PEFT,
and merged HF weights (dense and MoE) equal to the adapter model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lorarl.assets import DENSE_MODEL_DIR, MOE_MODEL_DIR
from lorarl.trainer.engines.megatron import convert
from lorarl.trainer.engines.megatron.engine import MegatronEngine
from lorarl.trainer.engines.megatron.model import compute_logits
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.lora import LoraConfig
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch

MODELS = {"dense": DENSE_MODEL_DIR, "moe": MOE_MODEL_DIR}
IDS = torch.tensor([[257, 10, 55, 43, 52, 258, 10, 9], [257, 40, 41, 42, 43, 44, 45, 46]])


def trained(path: Path, expert_mode: str = "per_expert") -> MegatronEngine:
    engine = MegatronEngine(make_spec(path, engine="megatron", lr=5e-2,
                                      lora=LoraConfig(rank=4, alpha=8, expert_mode=expert_mode)))
    for seed in (1, 2, 3):
        engine.train_step(synthetic_batch(seed, vocab=250, version=engine.version))
    return engine


def megatron_logits(engine: MegatronEngine) -> torch.Tensor:
    with torch.no_grad():
        return compute_logits(engine.model, IDS, engine.vocab_size).float()


def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


@pytest.mark.parametrize("which,expert_mode", [("dense", "per_expert"), ("moe", "per_expert"), ("moe", "shared")])
def test_peft_tensors_have_the_torch_engines_names_shapes_and_layout(which: str, expert_mode: str) -> None:
    engine = trained(MODELS[which], expert_mode)
    lora = LoraConfig(rank=4, alpha=8, expert_mode=expert_mode)
    want = dict(TorchEngine(make_spec(MODELS[which], lora=lora)).iter_adapter_tensors())
    got = dict(engine.iter_adapter_tensors())
    assert got.keys() == want.keys()
    assert all(got[k].shape == want[k].shape and got[k].dtype == torch.float32 for k in got)
    params = engine.named_trainable_parameters()
    peft = "base_model.model.model.layers.1."
    for p in ("q_proj", "k_proj", "v_proj"):  # one fused lora_A written to all three
        assert torch.equal(got[f"{peft}self_attn.{p}.lora_A.weight"], params["decoder.layers.1.self_attention."
                                                                              "linear_qkv.lora_A"])
    fused = convert.fuse_qkv(*(got[f"{peft}self_attn.{p}.lora_B.weight"] for p in ("q_proj", "k_proj", "v_proj")),
                             engine.layout)
    assert torch.equal(fused, params["decoder.layers.1.self_attention.linear_qkv.lora_B"])
    assert fused.abs().max() > 0  # trained, so a wrong split would show
    fc1 = "mlp.linear_fc1" if which == "dense" else ("mlp.experts.local_experts.5.linear_fc1" if expert_mode ==
                                                     "per_expert" else "mlp.experts.shared.linear_fc1")
    mlp = f"{peft}mlp." if which == "dense" else f"{peft}mlp.experts.5."
    gate_up = torch.cat([got[f"{mlp}gate_proj.lora_B.weight"], got[f"{mlp}up_proj.lora_B.weight"]])
    assert torch.equal(gate_up, params[f"decoder.layers.1.{fc1}.lora_B"])
    assert torch.equal(got[f"{mlp}gate_proj.lora_A.weight"], got[f"{mlp}up_proj.lora_A.weight"])


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_exported_adapter_gives_the_engines_logits_in_transformers_peft(which: str, tmp_path: Path) -> None:
    from peft import PeftModel

    engine = trained(MODELS[which])
    out = engine.export_adapter(tmp_path / "adapter")
    assert load_file(out / "adapter_model.safetensors").keys() == dict(engine.iter_adapter_tensors()).keys()
    base = AutoModelForCausalLM.from_pretrained(MODELS[which], dtype=torch.float32).eval()
    base_logits = hf_logits(base)
    adapted = megatron_logits(engine)
    assert (adapted - base_logits).abs().max() > 1e-2  # training moved the policy
    peft_model = PeftModel.from_pretrained(base, out).eval()
    assert (hf_logits(peft_model) - adapted).abs().max() <= 1e-4


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_merged_export_equals_the_adapter_model(which: str, tmp_path: Path) -> None:
    from peft import PeftModel

    engine = trained(MODELS[which])
    merged_dir = engine.export_merged(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert (hf_logits(merged) - megatron_logits(engine)).abs().max() <= 1e-4
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODELS[which], dtype=torch.float32),
                                        engine.export_adapter(tmp_path / "adapter")).eval()
    assert (hf_logits(merged) - hf_logits(adapter)).abs().max() <= 1e-4
    streamed = [name for name, _ in engine.iter_merged_tensors()]
    assert len(streamed) == len(set(streamed)) == len(load_file(merged_dir / "model.safetensors"))
    assert streamed[0] == "model.embed_tokens.weight" and streamed[-1] == "model.norm.weight"
