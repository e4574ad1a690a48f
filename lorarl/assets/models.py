"""Model configs and builders: the tiny shipped policies and shape-realistic random-init benchmark models.

Everything is built locally from configs written here; nothing is downloaded. The tiny configs are
chosen for vLLM's CPU backend: head_dim 32 is in its supported list, and the hidden sizes are small
multiples of 64 that its LoRA layers and transformers both accept. The benchmark shapes copy the
real Qwen3-0.6B and Qwen3-30B-A3B configs; only the depth (and optionally the expert count) shrink,
so per-layer kernels, LoRA shapes and the 151936-row vocabulary match the real models.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel, Qwen3Config, Qwen3MoeConfig

from lorarl.assets import tokenizer as tok

QWEN3_VOCAB_SIZE = 151_936
QWEN3_BOS_ID = 151_643  # <|endoftext|> in Qwen's tokenizer
QWEN3_EOS_ID = 151_645  # <|im_end|>

_TINY_COMMON: dict[str, Any] = {
    "vocab_size": tok.VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": tok.MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "bos_token_id": None,
    "eos_token_id": tok.EOS_TOKEN_ID,
    "pad_token_id": tok.PAD_TOKEN_ID,
    "use_cache": True,
}


def tiny_dense_config() -> Qwen3Config:
    """The shipped dense policy (``qwen3-tiny``): about 1M parameters, GQA 4 query / 2 KV heads."""
    return Qwen3Config(**_TINY_COMMON, intermediate_size=512)


def tiny_moe_config() -> Qwen3MoeConfig:
    """The shipped MoE policy (``qwen3-moe-tiny``): 8 experts, top-2, every layer sparse."""
    return Qwen3MoeConfig(
        **_TINY_COMMON,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    )


def tiny_a3b_router_config() -> Qwen3MoeConfig:
    """The tiny widths and vocabulary with Qwen3-30B-A3B's routing: top-8 of 128 experts in every layer. Random
    init, its routers are nearly flat, as a real 128-expert router's near-ties are: the shape where the rollout's
    and the trainer's routing part (routing replay's tests and benchmark)."""
    config = tiny_moe_config()
    config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size = 128, 8, 32
    return config


def _qwen3_dense_config(num_layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                        tied: bool) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40_960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tied,
        initializer_range=0.02,
        bos_token_id=QWEN3_BOS_ID,
        eos_token_id=QWEN3_EOS_ID,
        use_cache=True,
    )


def qwen3_0_6b_config(num_layers: int = 28) -> Qwen3Config:
    """Qwen3-0.6B's real shapes (hidden 1024, 16/8 heads of 128, MLP 3072, tied 151936 vocab),
    with ``num_layers`` of its 28 layers."""
    return _qwen3_dense_config(num_layers, 1024, 3072, 16, 8, tied=True)


def qwen3_1_7b_config(num_layers: int = 28) -> Qwen3Config:
    """Qwen3-1.7B's real shapes (hidden 2048, 16/8 heads of 128, MLP 6144, tied 151936 vocab)."""
    return _qwen3_dense_config(num_layers, 2048, 6144, 16, 8, tied=True)


def qwen3_8b_config(num_layers: int = 36) -> Qwen3Config:
    """Qwen3-8B's real shapes (hidden 4096, 32/8 heads of 128, MLP 12288, untied 151936 vocab)."""
    return _qwen3_dense_config(num_layers, 4096, 12288, 32, 8, tied=False)


def qwen3_30b_a3b_config(num_layers: int = 48, num_experts: int = 128, num_experts_per_tok: int = 8) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's real shapes (hidden 2048, 32/4 heads of 128, experts of 768, top-8 of 128,
    untied 151936 vocab), with ``num_layers`` of its 48 layers and optionally fewer experts."""
    if not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(f"need 1 <= num_experts_per_tok ({num_experts_per_tok}) <= num_experts ({num_experts})")
    return Qwen3MoeConfig(
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40_960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        moe_intermediate_size=768,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        bos_token_id=QWEN3_BOS_ID,
        eos_token_id=QWEN3_EOS_ID,
        use_cache=True,
    )


SHAPES: dict[str, Callable[..., PreTrainedConfig]] = {
    "qwen3-tiny": tiny_dense_config,
    "qwen3-moe-tiny": tiny_moe_config,
    "qwen3-moe-tiny-a3b-router": tiny_a3b_router_config,
    "qwen3-0.6b": qwen3_0_6b_config,
    "qwen3-1.7b": qwen3_1_7b_config,
    "qwen3-8b": qwen3_8b_config,
    "qwen3-30b-a3b": qwen3_30b_a3b_config,
}


def shape_config(shape: str, num_layers: int | None = None, num_experts: int | None = None) -> PreTrainedConfig:
    """The config for a named shape, with the depth and (MoE) expert count overridden if given."""
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    config = SHAPES[shape]()
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        config.layer_types = ["full_attention"] * num_layers
    if num_experts is not None:
        if not isinstance(config, Qwen3MoeConfig):
            raise ValueError(f"shape {shape!r} is dense; num_experts applies to MoE shapes only")
        config.num_experts = num_experts
        config.num_experts_per_tok = min(config.num_experts_per_tok, num_experts)
    return config


#: Random-init MoE shapes whose experts' weights are scaled up: at initializer_range 0.02 an expert's output is a
#: negligible part of the residual update, so which experts a token reaches hardly matters; in a trained model it
#: does (the experts are most of its parameters), and that is what routing replay is measured against.
EXPERT_INIT_SCALE = {"qwen3-moe-tiny-a3b-router": 10.0}


def init_model(config: PreTrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               expert_scale: float = 1.0) -> PreTrainedModel:
    """A randomly initialised causal LM for ``config``; the same seed gives the same weights. ``expert_scale``
    multiplies the MoE experts' weights (EXPERT_INIT_SCALE says why)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if expert_scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".experts." in name:
                    param.mul_(expert_scale)
    model.eval()
    return model


def generation_config(config: PreTrainedConfig) -> GenerationConfig:
    """Only the token ids: no sampling defaults, so vLLM and transformers sample as they are told."""
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def save_model(model: PreTrainedModel, out_dir: Path, with_tokenizer: bool = True) -> Path:
    """Save in HF format (config, generation config, safetensors) plus our tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = generation_config(model.config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if with_tokenizer:
        tok.save_tokenizer(out_dir)
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; these are shared read-only assets
    return out_dir


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def build_random_model(
    shape: str,
    out_dir: Path,
    num_layers: int | None = None,
    num_experts: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Random-init a named shape and save it to ``out_dir`` (for benchmarks); returns a summary."""
    config = shape_config(shape, num_layers=num_layers, num_experts=num_experts)
    model = init_model(config, seed=seed, dtype=dtype, expert_scale=EXPERT_INIT_SCALE.get(shape, 1.0))
    save_model(model, out_dir)
    summary = {
        "shape": shape,
        "out_dir": str(out_dir),
        "num_layers": config.num_hidden_layers,
        "num_experts": getattr(config, "num_experts", None),
        "parameters": count_parameters(model),
        "expert_scale": EXPERT_INIT_SCALE.get(shape, 1.0),
        "dtype": str(dtype).removeprefix("torch."),
    }
    (out_dir / "build_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
