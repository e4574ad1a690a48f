"""Random-init tiny Qwen3 models built in memory, for trainer unit tests."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)


def dense_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=48, **COMMON)).eval()


def moe_model(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            decoder_sparse_step=1, norm_topk_prob=True, **COMMON)
    return Qwen3MoeForCausalLM(config).eval()


def randomize_adapters(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> None:
    from lorarl.trainer.rl.lora import lora_parameters

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * std)
