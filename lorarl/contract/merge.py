"""The LoRA merge, W' = W + scale * B @ A: one arithmetic for the trainer's merged export, Megatron's,
the weight-sync service's local merge and the rollout's, so every merged tensor is bit-identical
whoever computes it. fp32 throughout (a bf16 merge would round the small update away), cast back to the
base's dtype; always from the pristine base, never from a previously merged weight."""

from __future__ import annotations

import torch


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * B @ A in fp32 (A [r, in], B [out, r])."""
    return (b.float() @ a.float()) * scale


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A, computed in fp32 on W's device and cast back to W's dtype."""
    return (weight.float() + lora_delta(a, b, scale).to(weight.device)).to(weight.dtype)
