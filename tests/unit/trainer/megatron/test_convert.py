"""HF <-> megatron conversion and TP/EP/PP sharding are exact inverses on the shipped tiny models."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from lorarl.trainer.engines.megatron import convert
from lorarl.trainer.engines.megatron.convert import RankCoords
from lorarl.trainer.engines.megatron.model import load_hf_state
from lorarl.trainer.engines.megatron.parallel import ParallelSettings

ASSETS = Path(__file__).resolve().parents[4] / "lorarl" / "assets" / "models"
MODELS = ("qwen3-tiny", "qwen3-moe-tiny")


def layout_of(name: str) -> convert.Qwen3Layout:
    return convert.layout_from_hf(convert.read_hf_config(ASSETS / name))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_layouts_are_read_from_the_shipped_configs() -> None:
    dense, moe = layout_of("qwen3-tiny"), layout_of("qwen3-moe-tiny")
    assert (dense.num_layers, dense.hidden_size, dense.num_heads, dense.num_kv_heads) == (4, 128, 4, 2)
    assert dense.head_dim == 32
    assert (dense.ffn_hidden_size, dense.vocab_size, dense.tied_embeddings, dense.num_experts) == (512, 264, True, 0)
    assert dense.rope_theta == 10000.0 and dense.rms_norm_eps == 1e-6 and not dense.is_moe_layer(0)
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.norm_topk_prob) == (8, 2, 128, True)
    assert moe.moe_layers == (True,) * 4


def test_unsupported_hf_configs_are_rejected() -> None:
    config = convert.read_hf_config(ASSETS / "qwen3-tiny")
    with pytest.raises(ValueError, match="model_type"):
        convert.layout_from_hf({**config, "model_type": "llama"})
    with pytest.raises(ValueError, match="rope_type"):
        convert.layout_from_hf({**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    sparse_every_2nd = convert.layout_from_hf({**convert.read_hf_config(ASSETS / "qwen3-moe-tiny"),
                                               "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert sparse_every_2nd.moe_layers == (False, True, False, False)


@pytest.mark.parametrize("name", MODELS)
def test_hf_to_megatron_to_hf_is_exact(name: str) -> None:
    layout = layout_of(name)
    hf = load_hf_state(ASSETS / name, torch.float32)
    mcore = convert.hf_to_megatron(hf, layout)
    assert "output_layer.weight" not in mcore  # tied: megatron shares the embedding
    assert mcore["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (4 * 32 + 2 * 2 * 32, 128)
    assert_same(convert.megatron_to_hf(mcore, layout), hf)


def test_transformers_fused_experts_convert_like_the_checkpoint() -> None:
    from transformers import AutoModelForCausalLM

    layout = layout_of("qwen3-moe-tiny")
    in_memory = AutoModelForCausalLM.from_pretrained(ASSETS / "qwen3-moe-tiny", dtype=torch.float32).state_dict()
    assert in_memory["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 256, 128)
    from_memory = convert.hf_to_megatron(in_memory, layout)
    from_disk = convert.hf_to_megatron(load_hf_state(ASSETS / "qwen3-moe-tiny", torch.float32), layout)
    assert_same(from_memory, from_disk)


def test_conversion_refuses_missing_and_unknown_tensors() -> None:
    layout = layout_of("qwen3-tiny")
    hf = load_hf_state(ASSETS / "qwen3-tiny", torch.float32)
    with pytest.raises(KeyError, match="q_norm"):
        convert.hf_to_megatron({k: v for k, v in hf.items() if "layers.2.self_attn.q_norm" not in k}, layout)
    with pytest.raises(ValueError, match="does not use"):
        convert.hf_to_megatron({**hf, "model.layers.9.extra.weight": torch.zeros(1)}, layout)


def test_qkv_is_grouped_per_kv_head_and_splits_back() -> None:
    layout = convert.Qwen3Layout(num_layers=1, hidden_size=2, num_heads=4, num_kv_heads=2, head_dim=1,
                                 ffn_hidden_size=2, vocab_size=4, tied_embeddings=True, rms_norm_eps=1e-6,
                                 rope_theta=1e4, max_position_embeddings=8)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads 0..3, one row each
    k, v = torch.tensor([[20.0], [21.0]]), torch.tensor([[30.0], [31.0]])
    fused = convert.fuse_qkv(q, k, v, layout)
    # group 0: q heads 0,1 then k0, v0; group 1: q heads 2,3 then k1, v1
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    for got, want in zip(convert.split_qkv(fused, layout), (q, k, v), strict=True):
        assert torch.equal(got, want)
    # a TP=2 shard holds whole groups and splits into that group's heads
    q1, k1, v1 = convert.split_qkv(convert.tp_shard("x.self_attention.linear_qkv.weight", fused, 1, 2), layout)
    assert q1.flatten().tolist() == [12, 13] and k1.flatten().tolist() == [21] and v1.flatten().tolist() == [31]
    lora_b = torch.arange(16.0).reshape(8, 2)  # [qkv rows, rank]
    assert torch.equal(convert.fuse_qkv(*convert.split_qkv(lora_b, layout), layout), lora_b)


def test_fc1_shards_keep_gate_and_up_halves() -> None:
    gate, up = torch.arange(4.0).view(4, 1), torch.arange(100.0, 104.0).view(4, 1)
    fused = convert.fuse_fc1(gate, up)
    shard1 = convert.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fused, 1, 2)
    assert shard1.flatten().tolist() == [2, 3, 102, 103]
    g, u = convert.split_fc1(shard1)
    assert g.flatten().tolist() == [2, 3] and u.flatten().tolist() == [102, 103]


def test_vocab_is_padded_to_a_multiple_of_tp_and_unpadded_on_merge() -> None:
    name = "embedding.word_embeddings.weight"
    emb = torch.randn(264, 3)
    assert convert.padded_vocab_size(264, 5) == 265
    shards = [convert.tp_shard(name, emb, r, 5) for r in range(5)]
    assert all(s.shape == (53, 3) for s in shards)
    assert torch.equal(shards[-1][-1], torch.zeros(3))
    assert torch.equal(convert.tp_merge(name, shards, vocab_size=264), emb)


def test_partition_dims() -> None:
    assert convert.tp_partition_dim("decoder.layers.3.self_attention.linear_qkv.weight") == 0
    assert convert.tp_partition_dim("decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight") == 0
    assert convert.tp_partition_dim("decoder.layers.3.self_attention.linear_proj.weight") == 1
    assert convert.tp_partition_dim("decoder.layers.3.mlp.linear_fc2.weight") == 1
    assert convert.tp_partition_dim("output_layer.weight") == 0
    assert convert.tp_partition_dim("decoder.layers.3.mlp.router.weight") is None
    assert convert.tp_partition_dim("decoder.layers.3.self_attention.q_layernorm.weight") is None


@pytest.mark.parametrize(("name", "tp", "pp", "ep"), [("qwen3-tiny", 2, 1, 1), ("qwen3-tiny", 2, 2, 1),
                                                       ("qwen3-moe-tiny", 2, 2, 2), ("qwen3-moe-tiny", 1, 1, 4)])
def test_shard_then_gather_is_exact(name: str, tp: int, pp: int, ep: int) -> None:
    layout = layout_of(name)
    full = convert.hf_to_megatron(load_hf_state(ASSETS / name, torch.float32), layout)
    states = {}
    for tp_rank, pp_rank, ep_rank in itertools.product(range(tp), range(pp), range(ep)):
        coords = RankCoords(tp_rank, tp, pp_rank, pp, ep_rank, ep)
        states[coords] = convert.shard_state(full, layout, coords)
    assert_same(convert.gather_states(states, layout), full)

    last = states[RankCoords(tp - 1, tp, pp - 1, pp, ep - 1, ep)]
    first = states[RankCoords(0, tp, 0, pp, 0, ep)]
    assert ("embedding.word_embeddings.weight" in first) and (("output_layer.weight" in last) == (pp > 1))
    assert ("embedding.word_embeddings.weight" in last) == (pp == 1)
    assert not any(k.startswith(f"decoder.layers.{layout.num_layers // pp}.") for k in first)  # local indices
    qkv = last["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (full["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] // tp, 128)
    if layout.num_experts:
        local = {k.split(".")[6] for k in last if ".local_experts." in k}
        assert local == {str(i) for i in range(layout.num_experts // ep)}
        last_expert = layout.num_experts - 1  # the last EP rank's last local expert
        src = full[f"decoder.layers.{layout.num_layers - 1}.mlp.experts.local_experts.{last_expert}.linear_fc2.weight"]
        mine = last[f"decoder.layers.{layout.num_layers // pp - 1}.mlp.experts.local_experts."
                    f"{layout.num_experts // ep - 1}.linear_fc2.weight"]
        assert torch.equal(mine, src.chunk(tp, dim=1)[tp - 1])


def test_parallel_settings_name_the_offending_setting() -> None:
    with pytest.raises(ValueError, match=r"megatron\.tensor_parallel_size"):
        ParallelSettings(tp=0)
    with pytest.raises(ValueError, match=r"megatron\.pipeline_parallel_size"):
        ParallelSettings(pp=2).check_world(3)
    with pytest.raises(ValueError, match=r"megatron\.expert_parallel_size"):
        ParallelSettings(ep=4).check_world(2)
    dense, moe = layout_of("qwen3-tiny"), layout_of("qwen3-moe-tiny")
    shape = dict(num_layers=4, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"megatron\.tensor_parallel_size=4 must divide"):
        ParallelSettings(tp=4).check_model(**shape, num_experts=dense.num_experts)
    with pytest.raises(ValueError, match=r"megatron\.pipeline_parallel_size=3"):
        ParallelSettings(pp=3).check_model(**shape, num_experts=0)
    with pytest.raises(ValueError, match="needs a mixture-of-experts"):
        ParallelSettings(ep=2).check_model(**shape, num_experts=0)
    with pytest.raises(ValueError, match=r"megatron\.expert_parallel_size=3 must divide the experts"):
        ParallelSettings(ep=3).check_model(**shape, num_experts=moe.num_experts)
    ParallelSettings(tp=2, pp=2, ep=2).check_model(**shape, num_experts=moe.num_experts)
    ParallelSettings(tp=2, pp=2, ep=2).check_world(8)


def test_transformer_config_matches_qwen3() -> None:
    moe = convert.transformer_config(layout_of("qwen3-moe-tiny"), ParallelSettings(ep=2))
    assert (moe.num_query_groups, moe.kv_channels, moe.qk_layernorm, moe.gated_linear_unit) == (2, 32, True, True)
    assert (moe.normalization, moe.layernorm_epsilon, moe.add_bias_linear) == ("RMSNorm", 1e-6, False)
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (8, 2, 128)
    assert moe.moe_router_pre_softmax is False and moe.moe_grouped_gemm is False  # softmax over the top-k
    assert moe.expert_model_parallel_size == 2 and moe.moe_shared_expert_intermediate_size is None
    config = convert.read_hf_config(ASSETS / "qwen3-moe-tiny")
    unnormalised = convert.layout_from_hf({**config, "norm_topk_prob": False})
    assert convert.transformer_config(unnormalised, ParallelSettings()).moe_router_pre_softmax is True
