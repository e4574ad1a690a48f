"""A megatron GPTModel built from the shipped HF checkpoints computes transformers' logits (TP=1, CPU, fp32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorarl.trainer.engines.megatron.model import build_gpt_model, compute_logits, set_training
from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel, teardown

ASSETS = Path(__file__).resolve().parents[4] / "lorarl" / "assets" / "models"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def single_process() -> Iterator[None]:
    """One-process gloo group with megatron's groups (tp=pp=ep=1), torn down after the module."""
    init_parallel(ParallelSettings(), "cpu", seed=0)
    yield
    teardown()


def prompts(vocab: int = 264) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (1, 6, 23)] + [
        torch.randint(0, vocab, (2, 13), generator=g)]


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_logits_match_transformers(single_process: None, name: str) -> None:
    from transformers import AutoModelForCausalLM

    built = build_gpt_model(ASSETS / name, ParallelSettings())
    hf = AutoModelForCausalLM.from_pretrained(ASSETS / name, dtype=torch.float32).eval()
    assert not any(p.requires_grad for p in built.model.parameters())
    with torch.no_grad():
        for ids in prompts():
            got = compute_logits(built.model, ids, built.layout.vocab_size)
            want = hf(ids).logits
            assert got.shape == want.shape == (*ids.shape, 264)
            assert (got - want).abs().max().item() <= TOLERANCE, f"{name} length {ids.shape[1]}"
            assert want.abs().max() > 0.1  # the comparison is not between two near-zero tensors


def test_backward_reaches_attention_router_and_experts(single_process: None) -> None:
    built = build_gpt_model(ASSETS / "qwen3-moe-tiny", ParallelSettings())
    named = dict(built.model.named_parameters())
    watched = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.router.weight",
               *(f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(8))]
    for name in watched:
        named[name].requires_grad_(True)
    ids = prompts()[-1]
    set_training(built.model, True)
    assert built.model.training and built.model.decoder.layers[0].mlp.training  # tp=1: MoE layers train too
    compute_logits(built.model, ids, built.layout.vocab_size).logsumexp(-1).sum().backward()
    assert named[watched[0]].grad.abs().sum() > 0 and named[watched[1]].grad.abs().sum() > 0
    experts_hit = sum(int(named[n].grad is not None and named[n].grad.abs().sum() > 0) for n in watched[2:])
    assert experts_hit >= 2  # top-2 routing of 26 tokens reaches several experts
