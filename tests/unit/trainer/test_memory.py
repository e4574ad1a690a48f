"""The activation formulas of lorarl.trainer.engines.memory against what autograd really saves: a transformers
Qwen3 / Qwen3-MoE layer with lorarl's LoRA, counted with saved-tensor hooks, in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from lorarl.assets.models import init_model
from lorarl.trainer.engines.memory import layer_activation_bytes, logits_bytes, needs_checkpointing, step_memory
from lorarl.trainer.engines.recompute import disable_activation_checkpointing
from lorarl.trainer.rl.lora import LoraConfig, inject_lora
from tests.unit.trainer.test_recompute import saved_bytes_per_token

DENSE = dict(vocab_size=256, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=512)
MOE = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
           num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
           max_position_embeddings=512, decoder_sparse_step=1, norm_topk_prob=True)


def counted_per_layer(config, rank: int, dtype: torch.dtype) -> float:
    model = init_model(config, dtype=torch.float32)
    inject_lora(model, LoraConfig(rank=rank, alpha=2 * rank))
    model = model.to(dtype).train()
    layers = model.model.layers
    counts = []
    for depth in (1, 2):
        model.model.layers = torch.nn.ModuleList(layers[:depth])
        model.config.num_hidden_layers = depth
        disable_activation_checkpointing(model)
        counts.append(saved_bytes_per_token(model, 56))
    return counts[1] - counts[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("kind", "rank"), [("dense", 8), ("dense", 32), ("moe", 16)])
def test_layer_activation_formula_matches_what_autograd_saves(kind: str, rank: int, dtype: str) -> None:
    fields = DENSE if kind == "dense" else MOE
    config = (Qwen3Config if kind == "dense" else Qwen3MoeConfig)(num_hidden_layers=2, **fields)
    counted = counted_per_layer(config, rank, getattr(torch, dtype))
    planned = layer_activation_bytes(config.to_dict(), rank, dtype)
    assert planned == pytest.approx(counted, rel=0.03), (planned, counted)


def test_step_memory_counts_checkpointing_and_logits_chunks() -> None:
    shape = dict(DENSE, num_hidden_layers=28, vocab_size=151936)
    plain = step_memory(shape, 16, "bfloat16", 8192, checkpointing=False, logits_chunk_tokens=0)
    chunked = step_memory(shape, 16, "bfloat16", 8192, checkpointing=False, logits_chunk_tokens=1024)
    checkpointed = step_memory(shape, 16, "bfloat16", 8192, checkpointing=True, logits_chunk_tokens=1024)
    per_layer = layer_activation_bytes(shape, 16, "bfloat16")
    # A frozen head (closed form): a 4·H fp32 basis per token, never [tokens, V]; the chunk only sizes the
    # forward's transient log-softmax and softmax.
    assert plain.kept == chunked.kept == 28 * 8192 * per_layer + 8192 * (2 + 4) * 512 and plain.recompute == 0
    assert plain.logits == logits_bytes(151936, 8192, "bfloat16", chunked=False) == 10 * 8192 * 151936
    assert chunked.logits == logits_bytes(151936, 1024, "bfloat16", chunked=True) == 10 * 1024 * 151936
    # A head that trains goes through autograd: whole, its fp32 log-softmax is kept; chunked, recomputed.
    trained = step_memory(shape, 16, "bfloat16", 8192, False, 0, frozen_head=False)
    trained_chunked = step_memory(shape, 16, "bfloat16", 8192, False, 1024, frozen_head=False)
    assert trained.kept == 28 * 8192 * per_layer + 8192 * (2 * 512 + 4 * 151936)
    assert trained.logits == 10 * 8192 * 151936
    assert trained_chunked.kept == 28 * 8192 * per_layer + 8192 * 2 * 512
    assert trained_chunked.logits == logits_bytes(151936, 1024, "bfloat16", True, frozen_head=False)
    assert trained_chunked.logits == 14 * 1024 * 151936
    checkpointed_kept = 8192 * (28 * 2 * 512 + (2 + 4) * 512)
    assert checkpointed.kept == checkpointed_kept and checkpointed.recompute == 8192 * per_layer
    assert checkpointed.total == checkpointed.kept + max(checkpointed.recompute, checkpointed.logits)
    assert checkpointed.activations < chunked.activations / 8
    assert needs_checkpointing(shape, 16, "bfloat16", 8192, 1024, free_bytes=chunked.total)
    assert not needs_checkpointing(shape, 16, "bfloat16", 8192, 1024, free_bytes=3 * chunked.total)
