"""A tiny random-init text-only Qwen3.5 (the Qwen3.6-27B architecture) written to disk, for trainer tests.

Same layer recipe as Qwen3.6-27B (``Qwen3_5ForConditionalGeneration``'s text model): hybrid layers with
every 4th one full attention (output-gated ``q_proj``, partial rotary 0.25, interleaved mrope) and the
others Gated DeltaNet linear attention (``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``/
``out_proj`` plus a causal conv), dense SiLU MLPs and untied embeddings. Only the sizes shrink: 4 layers
(3 linear + 1 full), hidden 64, the repo's 264-token byte tokenizer. No MTP layer: transformers does not
build one and vLLM drops ``mtp.*`` weights when it serves the model without speculative decoding.

Sizes are chosen for vLLM's CPU backend: full-attention head_dim 64 is in its supported list, and
the CPU Gated DeltaNet kernel runs in bf16 only, so the checkpoint is saved in bf16 (the trainer
upcasts it exactly to fp32).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from lorarl.assets import tokenizer as tok
from lorarl.assets.models import save_model

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
LINEAR_ATTENTION_PROJS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def tiny_qwen3_5_config() -> Qwen3_5TextConfig:
    """Qwen3.6-27B's text config with every size shrunk; the ratios that shape kernels are kept
    (3 value heads per key head in the linear layers, 2 query heads per KV head, rotary on a quarter)."""
    return Qwen3_5TextConfig(
        vocab_size=tok.VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        max_position_embeddings=tok.MODEL_MAX_LENGTH,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=tok.EOS_TOKEN_ID,
        pad_token_id=tok.PAD_TOKEN_ID,
        architectures=["Qwen3_5ForCausalLM"],
    )


def tiny_qwen3_5_model(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(tiny_qwen3_5_config())
    with torch.no_grad():  # random init leaves A_log/dt_bias at defaults; make every layer distinct
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                param.uniform_(-1.0, 1.0)
    return model.to(dtype).eval()


def build_tiny_qwen3_5(out_dir: Path, seed: int = 0) -> Path:
    """Writes config, bf16 safetensors, generation config and the byte tokenizer to ``out_dir``."""
    return save_model(tiny_qwen3_5_model(seed), out_dir)
