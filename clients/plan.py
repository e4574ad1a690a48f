"""`--dry-run`: check a job config and print a memory plan, without starting anything.

Sizes come from the model's config.json when the weights are present; otherwise from the
``model.shape`` named in the job file (known Qwen3 shapes), so configs for real models can be
checked on a machine that has neither the weights nor the accelerators.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GIB = 1 << 30

#: Published Qwen3 shapes (config.json fields) for planning without the weights.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False),
}


def model_shape(cfg) -> dict[str, Any]:
    config = Path(cfg.model.path) / "config.json"
    if config.is_file():
        return json.loads(config.read_text())
    shape = getattr(cfg.model, "shape", "")
    if shape in KNOWN_SHAPES:
        return KNOWN_SHAPES[shape]
    raise ValueError(f"model.path {cfg.model.path!r} has no config.json and model.shape {shape!r} is not one of "
                     f"{sorted(KNOWN_SHAPES)}")


def count(shape: dict[str, Any], rank: int) -> dict[str, int]:
    """Base parameters, and all-linear LoRA parameters (experts per expert) at ``rank``."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    hd = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    attn = h * q + 2 * h * kv + q * h
    attn_lora = rank * ((h + q) + 2 * (h + kv) + (q + h))
    experts = shape.get("num_experts", 0)
    if experts:
        inter = shape["moe_intermediate_size"]
        mlp = experts * 3 * h * inter + experts * h
        mlp_lora = experts * rank * 3 * (h + inter)
    else:
        inter = shape["intermediate_size"]
        mlp, mlp_lora = 3 * h * inter, rank * 3 * (h + inter)
    embed = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    return {"base": embed + layers * (attn + mlp), "lora": layers * (attn_lora + mlp_lora), "experts": experts}


def print_plan(cfg) -> int:
    try:
        shape = model_shape(cfg)
    except ValueError as e:
        print(f"lorarl: bad config: model.path: {e}")
        return 2
    n = count(shape, cfg.trainer.lora.rank)
    bytes_per = 2 if cfg.model.dtype == "bfloat16" else 4
    base_gib = n["base"] * bytes_per / GIB
    adapter_gib = n["lora"] * 4 / GIB
    optimizer_gib = n["lora"] * 8 / GIB
    moe_on_cpu = bool(n["experts"]) and cfg.rollout.engine == "vllm" and cfg.trainer.device == "cpu"
    mode = cfg.sync.mode if cfg.sync.mode != "auto" else ("merged" if moe_on_cpu else "adapter (if replicas can)")
    print(f"job {cfg.job_id}: {cfg.loop.mode} loop, {cfg.loop.steps} steps x {cfg.loop.prompts_per_step} prompts x "
          f"{cfg.rollout.group_size} samples, staleness <= {cfg.loop.max_staleness}")
    print(f"model {cfg.model.path}: {n['base'] / 1e9:.2f} B parameters ({base_gib:.1f} GiB in {cfg.model.dtype})"
          + (f", {n['experts']} experts" if n["experts"] else ""))
    print(f"trainer ({cfg.trainer.device}): base {base_gib:.1f} GiB + adapters {adapter_gib * 1024:.0f} MiB "
          f"(rank {cfg.trainer.lora.rank}, {100 * n['lora'] / n['base']:.2f}% of base) + Adam state "
          f"{optimizer_gib * 1024:.0f} MiB + activations")
    print(f"rollout ({cfg.rollout.engine}): base {base_gib:.1f} GiB + KV cache {cfg.rollout.kv_cache_gib} GiB")
    print(f"weight sync: {mode}; per version {adapter_gib * 1024:.0f} MiB (adapter, fp32) vs "
          f"{base_gib * 1024:.0f} MiB (merged)")
    print("config OK")
    return 0
