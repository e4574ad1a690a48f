"""MegatronEngine (TP=1, one process) on the shipped tiny Qwen3 / Qwen3-MoE: the torch engine's logprobs
for the same adapter, a learning signal, a frozen base, exact micro-batching and bit-exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorarl.assets import DENSE_MODEL_DIR, MOE_MODEL_DIR
from lorarl.trainer.engines import checkpoint as ckpt
from lorarl.trainer.engines.api import MegatronSpec, TrainingSpec, TrajectoryRecord
from lorarl.trainer.engines.factory import create_engine
from lorarl.trainer.engines.megatron.engine import MegatronEngine
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.lora import LoraConfig, load_peft_state_dict
from lorarl.trainer.rl.losses import LossSpec
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch

MODELS = {"dense": DENSE_MODEL_DIR, "moe": MOE_MODEL_DIR}
VOCAB = 250  # token ids below the tiny models' vocabulary (264)


def megatron_spec(path: Path, **kwargs: object) -> TrainingSpec:
    return make_spec(path, engine="megatron", **kwargs)


def randomize(engine: MegatronEngine, seed: int = 3, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in engine.named_trainable_parameters().values():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def on_policy(engine: MegatronEngine, records: list[TrajectoryRecord]) -> list[TrajectoryRecord]:
    for rec, lp in zip(records, engine.compute_logprobs(records), strict=True):
        rec.behavior_logprobs, rec.token_versions = lp, [engine.version] * len(lp)
    return records


@pytest.mark.parametrize("which,expert_mode", [("dense", "per_expert"), ("moe", "per_expert"), ("moe", "shared")])
def test_same_adapter_gives_the_torch_engines_logprobs(which: str, expert_mode: str) -> None:
    lora = LoraConfig(rank=4, alpha=8, expert_mode=expert_mode)
    engine = create_engine(megatron_spec(MODELS[which], lora=lora))
    assert isinstance(engine, MegatronEngine)
    randomize(engine)
    torch_engine = TorchEngine(make_spec(MODELS[which], lora=lora))
    load_peft_state_dict(torch_engine.model, dict(engine.iter_adapter_tensors()))  # every tensor, exact shapes
    batch = synthetic_batch(4, vocab=VOCAB)
    policy, base = engine.compute_logprobs(batch), engine.compute_logprobs(batch, reference=True)
    assert max_diff(policy, torch_engine.compute_logprobs(batch)) <= 1e-4
    assert max_diff(base, torch_engine.compute_logprobs(batch, reference=True)) <= 1e-4
    assert max_diff(policy, base) > 1e-2  # the adapter matters, so the comparison above can fail


def grpo_pair(engine: MegatronEngine) -> list[TrajectoryRecord]:
    prompt, good, bad = [1, 5, 9], [10, 11, 12, 13], [20, 21, 22, 23]
    return on_policy(engine, [TrajectoryRecord(prompt, good, [], [], 1.0, "g"),
                              TrajectoryRecord(prompt, bad, [], [], 0.0, "g")])


def test_a_lora_step_lowers_the_loss_on_a_fixed_batch() -> None:
    engine = MegatronEngine(megatron_spec(DENSE_MODEL_DIR, lr=2e-3))
    fixed = grpo_pair(engine)
    first = engine.train_step(fixed)
    second = engine.train_step(fixed)  # the same batch, one update later
    assert first["loss"] == pytest.approx(0.0, abs=1e-6)  # on-policy: ratio 1, zero-mean advantages
    assert second["loss"] < -1e-2, second["loss"]


def test_grpo_steps_move_towards_the_rewarded_completion() -> None:
    engine = MegatronEngine(megatron_spec(DENSE_MODEL_DIR, lr=2e-2))
    probe = grpo_pair(engine)
    before = [sum(lp) for lp in engine.compute_logprobs(probe)]
    for _ in range(5):
        metrics = engine.train_step(grpo_pair(engine))
    after = [sum(lp) for lp in engine.compute_logprobs(probe)]
    assert after[0] - before[0] > 1.0 and before[1] - after[1] > 1.0, (before, after)
    assert engine.version == engine.step == 5 and metrics["version"] == 5
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "lr", "tokens", "time_s"):
        assert math.isfinite(metrics[key]), key


def test_base_is_frozen_and_only_adapters_train() -> None:
    engine = MegatronEngine(megatron_spec(MOE_MODEL_DIR))
    adapters = {id(p) for p in engine.named_trainable_parameters().values()}
    names = list(engine.named_trainable_parameters())
    assert "decoder.layers.0.self_attention.linear_qkv.lora_A" in names
    assert "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.lora_B" in names
    base_before = dict(engine.iter_base_tensors())
    engine.train_step(synthetic_batch(1, vocab=VOCAB))
    engine.forward_backward(synthetic_batch(2, vocab=VOCAB))
    for name, p in engine.model.named_parameters():
        if id(p) not in adapters:
            assert not p.requires_grad and p.grad is None, name
    assert len(engine.optimizer.state) == len(adapters)
    hf = {}
    for file in MOE_MODEL_DIR.glob("*.safetensors"):
        hf.update(load_file(file))
    assert base_before.keys() == {k for k in hf if k != "lm_head.weight"}
    for name, tensor in engine.iter_base_tensors():
        assert torch.equal(tensor, hf[name]) and torch.equal(tensor, base_before[name]), name
    assert engine.trainable_parameters == sum(p.numel() for p in engine.named_trainable_parameters().values())
    assert engine.trainable_parameters < engine.total_parameters


def test_micro_batched_gradients_equal_the_full_batch() -> None:
    loss = LossSpec(type="grpo", kl_coef=0.1, entropy_coef=0.01)
    grads = []
    for budget in (0, 16):
        engine = MegatronEngine(megatron_spec(MOE_MODEL_DIR, micro_batch_tokens=budget, loss=loss))
        randomize(engine)
        metrics = engine.forward_backward(synthetic_batch(7, vocab=VOCAB))
        grads.append(({n: p.grad.clone() for n, p in engine.named_trainable_parameters().items()}, metrics))
    (full, fm), (micro, mm) = grads
    assert max(g.abs().max().item() for g in full.values()) > 1e-3
    for name in full:
        torch.testing.assert_close(micro[name], full[name], rtol=0, atol=1e-5, msg=name)
    for key in ("loss", "kl", "entropy"):
        assert mm[key] == pytest.approx(fm[key], abs=1e-5), key


def resumable(path: Path) -> TrainingSpec:
    # Dropout: the RNG state matters; warmup + cosine: the step; weight decay + micro-batches: optimiser state.
    return megatron_spec(path, lr=1e-2, micro_batch_tokens=20, lora=LoraConfig(rank=4, alpha=8, dropout=0.1),
                         optimizer={"warmup_steps": 2, "total_steps": 6, "weight_decay": 0.01})


def test_resume_is_exact(tmp_path: Path) -> None:
    batches = [synthetic_batch(seed, vocab=VOCAB) for seed in range(3)]
    straight = MegatronEngine(resumable(MOE_MODEL_DIR))
    expected = [straight.train_step(b) for b in batches]
    first = MegatronEngine(resumable(MOE_MODEL_DIR))
    for b in batches[:2]:
        first.train_step(b)
    info = first.save_checkpoint(tmp_path / "ckpt", data_cursor={"next": 2})
    assert (info.step, info.version) == (2, 2)
    resumed = MegatronEngine(resumable(MOE_MODEL_DIR))
    loaded = resumed.load_checkpoint(tmp_path / "ckpt")
    assert loaded.data_cursor == {"next": 2} and resumed.version == 2
    metrics = resumed.train_step(batches[2])
    for key in ("loss", "grad_norm", "lr", "entropy", "clip_fraction"):
        assert metrics[key] == expected[2][key], key
    want = straight.named_trainable_parameters()
    for name, p in resumed.named_trainable_parameters().items():
        assert torch.equal(p, want[name]), name
    assert resumed.version == straight.version == 3


def test_checkpoints_refuse_another_adapter_shape(tmp_path: Path) -> None:
    engine = MegatronEngine(megatron_spec(DENSE_MODEL_DIR))
    engine.save_checkpoint(tmp_path / "ckpt")
    other = MegatronEngine(megatron_spec(DENSE_MODEL_DIR, lora=LoraConfig(rank=8, alpha=16)))
    with pytest.raises(ckpt.CheckpointMismatchError, match="rank"):
        other.load_checkpoint(tmp_path / "ckpt")


def test_job_spec_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"megatron\.tensor_parallel_size"):
        MegatronSpec(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="engine 'megatron' only"):
        make_spec(DENSE_MODEL_DIR, megatron=MegatronSpec(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="full_finetune"):
        MegatronEngine(megatron_spec(DENSE_MODEL_DIR, full_finetune=True))
    with pytest.raises(ValueError, match="megatron fuses"):
        MegatronEngine(megatron_spec(DENSE_MODEL_DIR, lora=LoraConfig(target_modules=("q_proj",))))


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_activation_checkpointing_trains_exactly_what_the_plain_layers_train(which: str) -> None:
    from lorarl.trainer.engines.api import MemorySpec

    batch = synthetic_batch(6, vocab=VOCAB)
    grads = {}
    for mode in ("off", "on"):
        engine = create_engine(megatron_spec(MODELS[which], memory=MemorySpec(activation_checkpointing=mode)))
        assert engine.activation_checkpointing == (mode == "on")
        randomize(engine)
        metrics = engine.forward_backward(batch)
        grads[mode] = (metrics["loss"], {n: p.grad.clone() for n, p in engine.named_trainable_parameters().items()
                                         if p.grad is not None})
    assert grads["on"][0] == pytest.approx(grads["off"][0], abs=1e-6)
    assert grads["on"][1].keys() == grads["off"][1].keys() and grads["off"][1]
    for name, grad in grads["off"][1].items():
        torch.testing.assert_close(grads["on"][1][name], grad, rtol=1e-5, atol=1e-7)
