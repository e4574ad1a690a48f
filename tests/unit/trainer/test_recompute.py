"""Activation checkpointing and chunked log-probabilities (lorarl.trainer.engines.recompute) compute what the
plain path computes — logprobs, entropies and LoRA gradients, on the plain and the shared-prompt
forward, dense and MoE, with and without LoRA dropout — while keeping far fewer bytes for backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorarl.assets.models import init_model, shape_config
from lorarl.assets.paths import DENSE_MODEL_DIR, MOE_MODEL_DIR
from lorarl.trainer.engines.api import MemorySpec, TrajectoryRecord
from lorarl.trainer.engines.policy_engine import token_logprobs
from lorarl.trainer.engines.recompute import (
    activation_checkpointing_enabled,
    chunked_token_logprobs,
    disable_activation_checkpointing,
    enable_activation_checkpointing,
)
from lorarl.trainer.engines.torch.engine import TorchEngine, completion_logprobs
from lorarl.trainer.rl.batching import pack
from lorarl.trainer.rl.lora import LoraConfig, inject_lora, lora_parameters
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.test_prefix_sharing import groups
from tests.unit.trainer.tiny import randomize_adapters

MODELS = {"dense": DENSE_MODEL_DIR, "moe": MOE_MODEL_DIR}


def lora_model(path: Path, dropout: float = 0.0) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    inject_lora(model, LoraConfig(rank=4, alpha=8, dropout=dropout))
    randomize_adapters(model, std=0.02)
    return model.train()


def run(model: torch.nn.Module, records: list[TrajectoryRecord], share: bool, packed: bool = True,
        chunk: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    for p in lora_parameters(model):
        p.grad = None
    batch = pack(records)
    torch.manual_seed(seed)  # the same dropout draws in every variant
    logp, entropy = completion_logprobs(model, batch, entropy_grad=True, share_prompts=share, pack_completions=packed,
                                        logits_chunk_tokens=chunk)
    ((logp * batch.mask).sum() + 0.1 * (entropy * batch.mask).sum()).backward()
    return logp.detach(), entropy.detach(), [p.grad.clone() for p in lora_parameters(model)]


def assert_same(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for g, w in zip(got[2], want[2], strict=True):
        assert w.norm() > 0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize(("share", "packed"), [(False, False), (True, False), (True, True)])
def test_checkpointed_layers_give_the_plain_logprobs_and_gradients(kind: str, share: bool, packed: bool) -> None:
    model = lora_model(MODELS[kind])
    records = groups(3, n_groups=3, size=4)
    plain = run(model, records, share, packed)
    assert enable_activation_checkpointing(model) == model.config.num_hidden_layers
    assert activation_checkpointing_enabled(model)
    names = [n for n, _ in model.named_parameters()]
    assert_same(run(model, records, share, packed), plain)
    disable_activation_checkpointing(model)
    assert not activation_checkpointing_enabled(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert_same(run(model, records, share, packed), plain)


def test_checkpointing_replays_lora_dropout_draws() -> None:
    model = lora_model(DENSE_MODEL_DIR, dropout=0.3)
    records = groups(5, n_groups=2, size=3)
    plain = run(model, records, share=True, seed=7)
    other_draws = run(model, records, share=True, seed=8)
    assert not torch.allclose(other_draws[0], plain[0])  # the dropout is live: draws matter
    enable_activation_checkpointing(model)
    assert_same(run(model, records, share=True, seed=7), plain)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
def test_chunked_logprobs_equal_the_whole_micro_batch(entropy_grad: bool, chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(24, 50, bias=False)
    hidden = torch.randn(3, 5, 24, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 5), generator=g)
    results = []
    for c in (0, chunk):
        head.zero_grad()
        hidden.grad = None
        logp, entropy = chunked_token_logprobs(hidden, head, targets, entropy_grad, token_logprobs, c)
        (logp.sum() + (0.5 * entropy.sum() if entropy_grad else 0.0)).backward()
        results.append((logp.detach(), entropy.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_chunked_logprobs_through_the_engine_path_equal_the_plain_one() -> None:
    """The frozen head's closed form in chunks (lorarl.trainer.engines.head_logprobs) against autograd through the
    whole micro-batch's log-softmax (the route a head that trains takes)."""
    model = lora_model(DENSE_MODEL_DIR)
    records = groups(11, n_groups=3, size=4)
    fused = run(model, records, share=True, chunk=5)
    model.lm_head.weight.requires_grad_(True)
    plain = run(model, records, share=True, chunk=0)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-6)
    # The closed form sums p * log p as a matmul, the plain path with sum(): fp32 rounding apart.
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-5)
    for g, w in zip(fused[2], plain[2], strict=True):
        assert w.norm() > 0
        # Both sit ~7e-6 (of the largest entry) from a float64 run of the same model: fp32 noise, not a bias.
        torch.testing.assert_close(g, w, rtol=1e-4, atol=float(w.abs().max()) * 3e-5)


def saved_bytes_per_token(model: torch.nn.Module, tokens: int) -> float:
    """Bytes autograd keeps for backward per token of the sequence (parameters excluded)."""
    prompt = list(range(1, 9))
    records = [TrajectoryRecord(prompt, list(range(10, 10 + tokens)), [-1.0] * tokens, [0] * tokens, 1.0)]
    batch = pack(records)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        completion_logprobs(model, batch, share_prompts=False)
    return sum(v for k, v in seen.items() if k not in params) / (len(prompt) + tokens)


@pytest.mark.slow
def test_checkpointing_keeps_under_an_eighth_of_the_activations_at_the_8b_layer_shape() -> None:
    """Two layers of Qwen3-8B's shape in bf16, rank-32 LoRA: per token per layer, checkpointed layers keep
    their input only (8 KiB) against ~185 KiB; the difference of 2 and 1 layers isolates the layers."""
    config = shape_config("qwen3-8b", num_layers=2)
    config.vocab_size = 512  # the LM head is not what this measures
    model = init_model(config, dtype=torch.bfloat16)
    inject_lora(model, LoraConfig(rank=32, alpha=64))
    model = model.to(torch.bfloat16).train()
    layers = model.model.layers
    per_layer = {}
    for checkpointing in (False, True):
        counts = []
        for depth in (1, 2):
            model.model.layers = torch.nn.ModuleList(layers[:depth])
            model.config.num_hidden_layers = depth
            (enable_activation_checkpointing if checkpointing else disable_activation_checkpointing)(model)
            counts.append(saved_bytes_per_token(model, 64))
        per_layer[checkpointing] = counts[1] - counts[0]
    assert per_layer[False] > 150 * 1024
    assert per_layer[True] <= per_layer[False] / 8, per_layer
    assert per_layer[True] == pytest.approx(4096 * 2, rel=0.01)


def test_engine_memory_settings_switch_checkpointing_and_train_alike(tmp_path: Path) -> None:
    records = synthetic_batch(2, groups=3, group_size=4)
    results = {}
    for mode in ("off", "on", "auto"):
        engine = TorchEngine(make_spec(DENSE_MODEL_DIR, memory=MemorySpec(activation_checkpointing=mode,
                                                                               logits_chunk_tokens=8)))
        assert engine.activation_checkpointing == (mode == "on")
        metrics = engine.forward_backward(records)
        engine.optim_step()
        assert engine.activation_checkpointing == (mode == "on")  # auto: the tiny model fits, stays off
        results[mode] = (metrics["loss"], [p.detach().clone() for p in engine.named_trainable_parameters().values()])
    for mode in ("on", "auto"):
        assert results[mode][0] == pytest.approx(results["off"][0], abs=1e-6)
        for got, want in zip(results[mode][1], results["off"][1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_auto_checkpoints_a_micro_batch_that_would_crowd_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import lorarl.trainer.engines.policy_engine as policy_engine

    engine = TorchEngine(make_spec(DENSE_MODEL_DIR))
    monkeypatch.setattr(policy_engine, "free_device_bytes", lambda device: 1 << 20)  # 1 MiB free
    engine.forward_backward(synthetic_batch(4, groups=2, group_size=4))
    assert engine.activation_checkpointing
    monkeypatch.setattr(policy_engine, "free_device_bytes", lambda device: 1 << 40)
    engine.forward_backward(synthetic_batch(4, groups=2, group_size=4))
    assert not engine.activation_checkpointing


def test_memory_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing"):
        MemorySpec(activation_checkpointing="sometimes")
    with pytest.raises(ValueError, match="logits_chunk_tokens"):
        MemorySpec(logits_chunk_tokens=-1)
