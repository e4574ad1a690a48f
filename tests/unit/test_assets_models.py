"""Model builders: tiny configs fit vLLM's CPU backend; benchmark shapes are the real Qwen3 shapes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorarl.assets.build import main as build_main
from lorarl.assets.build import parse_args
from lorarl.assets.models import (
    QWEN3_VOCAB_SIZE,
    count_parameters,
    init_model,
    qwen3_0_6b_config,
    qwen3_30b_a3b_config,
    shape_config,
    tiny_dense_config,
    tiny_moe_config,
)
from lorarl.assets.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

CPU_ATTENTION_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


def _meta_parameters(config) -> int:
    """Parameter count of a full-size model without allocating it."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return count_parameters(model)


@pytest.mark.parametrize("config", [tiny_dense_config(), tiny_moe_config()], ids=["dense", "moe"])
def test_tiny_configs_suit_vllm_cpu(config):
    assert config.head_dim in CPU_ATTENTION_HEAD_SIZES
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.vocab_size == VOCAB_SIZE
    assert config.eos_token_id == EOS_TOKEN_ID
    assert _meta_parameters(config) < 5_000_000


def test_qwen3_0_6b_shape_is_real():
    config = qwen3_0_6b_config(num_layers=2)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (1024, 3072, QWEN3_VOCAB_SIZE)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 8, 128)
    assert config.tie_word_embeddings and config.num_hidden_layers == 2
    # The full depth has Qwen3-0.6B's 0.6B parameters (0.44B outside the embeddings).
    assert _meta_parameters(qwen3_0_6b_config()) == pytest.approx(596e6, rel=0.01)


def test_qwen3_30b_a3b_shape_is_real():
    config = qwen3_30b_a3b_config(num_layers=2)
    assert (config.hidden_size, config.moe_intermediate_size, config.vocab_size) == (2048, 768, QWEN3_VOCAB_SIZE)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    assert (config.num_experts, config.num_experts_per_tok) == (128, 8)
    assert not config.tie_word_embeddings
    assert _meta_parameters(qwen3_30b_a3b_config()) == pytest.approx(30.5e9, rel=0.01)


def test_shape_overrides():
    config = shape_config("qwen3-30b-a3b", num_layers=3, num_experts=16)
    assert (config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (3, 16, 8)
    assert config.hidden_size == 2048
    assert shape_config("qwen3-30b-a3b", num_experts=4).num_experts_per_tok == 4
    with pytest.raises(ValueError, match="dense"):
        shape_config("qwen3-0.6b", num_experts=8)
    with pytest.raises(KeyError, match="known"):
        shape_config("llama-7b")


def test_two_layer_0_6b_model_builds_with_real_shapes():
    model = init_model(shape_config("qwen3-0.6b", num_layers=2), dtype=torch.bfloat16)
    layer = model.model.layers[0]
    assert len(model.model.layers) == 2
    assert model.model.embed_tokens.weight.shape == (QWEN3_VOCAB_SIZE, 1024)
    assert layer.self_attn.q_proj.weight.shape == (16 * 128, 1024)
    assert layer.self_attn.k_proj.weight.shape == (8 * 128, 1024)
    assert layer.mlp.gate_proj.weight.shape == (3072, 1024)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def test_init_is_seeded():
    first = init_model(tiny_dense_config(), seed=3).state_dict()
    second = init_model(tiny_dense_config(), seed=3).state_dict()
    other = init_model(tiny_dense_config(), seed=4).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_build_cli_saves_a_loadable_random_model(tmp_path, capsys):
    out = tmp_path / "moe"
    assert build_main(["--shape", "qwen3-moe-tiny", "--layers", "2", "--experts", "4", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["num_experts"] == 4
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["dtype"] == "bfloat16"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.num_experts == 4


def test_build_cli_validates_arguments():
    with pytest.raises(SystemExit):
        parse_args(["--shape", "qwen3-0.6b"])  # no --out
    with pytest.raises(SystemExit):
        parse_args(["--out", "/tmp/x"])  # no --shape
    assert parse_args(["--only", "tokenizer", "tasks"]).only == ["tokenizer", "tasks"]
