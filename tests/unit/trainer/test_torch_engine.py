"""TorchEngine on tiny real Qwen3 / Qwen3-MoE checkpoints: learning signal, exact gradient
accumulation, frozen base, bf16, logprob alignment, and exports that load in PEFT / transformers."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lorarl.trainer.engines.api import AdamStep, EngineStateError, OptimizerSpec, TrajectoryRecord
from lorarl.trainer.engines.factory import create_engine
from lorarl.trainer.engines.torch.engine import TorchEngine, completion_logprobs, scheduled_lr
from lorarl.trainer.rl.batching import pack
from lorarl.trainer.rl.lora import LoraConfig, iter_merged_weights, lora_parameters
from lorarl.trainer.rl.losses import LossSpec
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.tiny import randomize_adapters

IDS = torch.tensor([[1, 5, 9, 13, 20, 33, 40, 2]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS.to(next(model.parameters()).device)).logits.float().cpu()


def on_policy(engine: TorchEngine, records: list[TrajectoryRecord]) -> list[TrajectoryRecord]:
    """Fills behaviour logprobs and versions as if the current policy had sampled the completions."""
    for rec, lp in zip(records, engine.compute_logprobs(records), strict=True):
        rec.behavior_logprobs = lp
        rec.token_versions = [engine.version] * len(lp)
    return records


def grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.named_trainable_parameters().items() if p.grad is not None}


def test_grpo_steps_raise_the_rewarded_completion_and_lower_the_other(dense_dir: Path) -> None:
    engine = create_engine(make_spec(dense_dir, lr=2e-2))
    assert isinstance(engine, TorchEngine) and engine.version == 0 and engine.step == 0
    prompt, good, bad = [1, 5, 9], [10, 11, 12, 13], [20, 21, 22, 23]

    def batch() -> list[TrajectoryRecord]:
        return on_policy(engine, [TrajectoryRecord(prompt, good, [], [], 1.0, "g"),
                                  TrajectoryRecord(prompt, bad, [], [], 0.0, "g")])

    before = [sum(lp) for lp in engine.compute_logprobs(batch())]
    for _ in range(5):
        metrics = engine.train_step(batch())
    after = [sum(lp) for lp in engine.compute_logprobs(batch())]
    assert after[0] - before[0] > 1.0, (before, after)
    assert before[1] - after[1] > 1.0, (before, after)
    assert engine.version == 5 and engine.step == 5
    for key in ("loss", "pg_loss", "clip_fraction", "entropy", "grad_norm", "tokens", "sequences", "time_s", "lr",
                "version"):
        assert math.isfinite(metrics[key]), key
    assert metrics["tokens"] == 8 and metrics["sequences"] == 2 and metrics["version"] == 5
    assert metrics["lr"] == pytest.approx(2e-2) and metrics["grad_norm"] > 0


@pytest.fixture(scope="module")
def warm_checkpoint(dense_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapters away from zero and version 2, so KL, staleness and decoupling all have an effect."""
    engine = TorchEngine(make_spec(dense_dir))
    randomize_adapters(engine.model, std=0.05)
    for seed in (1, 2):
        engine.train_step(synthetic_batch(seed, version=engine.version))
    path = tmp_path_factory.mktemp("warm") / "ckpt"
    engine.save_checkpoint(path)
    return path


@pytest.mark.parametrize("loss", [
    LossSpec(type="grpo"),
    LossSpec(type="dr_grpo"),
    LossSpec(type="dapo", clip_eps_high=0.28, max_staleness=1),  # token-mean, stale tokens masked
    LossSpec(type="grpo", kl_coef=0.2, entropy_coef=0.05),
    LossSpec(type="gspo", behavior_weight_cap=2.0),
    LossSpec(type="ppo", dual_clip=3.0),
], ids=["grpo", "dr_grpo", "dapo-stale", "grpo-kl-entropy", "gspo-decoupled", "ppo-dual"])
def test_micro_batched_gradients_equal_the_full_batch(dense_dir: Path, warm_checkpoint: Path,
                                                      loss: LossSpec) -> None:
    batch = synthetic_batch(7, groups=3, group_size=3, max_version=2)
    engines = {}
    for budget in (0, 16):
        engine = TorchEngine(make_spec(dense_dir, micro_batch_tokens=budget, loss=loss))
        engine.load_checkpoint(warm_checkpoint)
        engines[budget] = engine
    full_metrics = engines[0].forward_backward(batch)
    micro_metrics = engines[16].forward_backward(batch)
    full, micro = grads(engines[0]), grads(engines[16])
    assert full.keys() == micro.keys() and full
    assert max(g.abs().max().item() for g in full.values()) > 1e-3  # a real gradient, not zeros
    for name in full:
        torch.testing.assert_close(micro[name], full[name], rtol=0, atol=1e-5, msg=name)
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "kl"):
        if key in full_metrics:
            assert micro_metrics[key] == pytest.approx(full_metrics[key], abs=1e-5), key
    if loss.max_staleness:
        assert full_metrics["loss_tokens"] < full_metrics["tokens"]
    if loss.kl_coef:
        assert full_metrics["kl"] > 0


def test_micro_batches_are_really_split(dense_dir: Path) -> None:
    from lorarl.trainer.rl.batching import micro_batches

    batch = synthetic_batch(7, groups=3, group_size=3, max_version=2)
    groups = micro_batches([r.num_tokens for r in batch], 16)
    assert len(groups) >= 4 and len({sum(batch[i].num_tokens for i in g) for g in groups}) > 1


def test_base_weights_get_no_gradient_or_optimizer_state(moe_dir: Path) -> None:
    engine = TorchEngine(make_spec(moe_dir, lora=LoraConfig(rank=4, alpha=8, expert_mode="per_expert")))
    for seed in (1, 2):
        engine.train_step(synthetic_batch(seed))
    engine.forward_backward(synthetic_batch(3))  # leave gradients in place to inspect them
    adapters = {id(p) for p in lora_parameters(engine.model)}
    assert {id(p) for p in engine.named_trainable_parameters().values()} == adapters
    assert engine.trainable_parameters == sum(p.numel() for p in lora_parameters(engine.model))
    assert engine.trainable_parameters < engine.total_parameters
    for name, p in engine.model.named_parameters():
        if id(p) not in adapters:
            assert not p.requires_grad and p.grad is None, name
    assert {id(p) for p in engine.optimizer.state} <= adapters and len(engine.optimizer.state) == len(adapters)
    base = dict(iter_merged_weights(AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)))
    for name, tensor in iter_merged_weights(engine.model, merge=False):
        assert torch.equal(tensor.cpu(), base[name]), name
    assert any(p.abs().sum() > 0 for n, p in engine.model.named_parameters() if "lora_b" in n)


def test_bf16_step_keeps_base_bf16_and_adapters_fp32(dense_dir: Path) -> None:
    engine = TorchEngine(make_spec(dense_dir, dtype="bfloat16"))
    metrics = engine.train_step(synthetic_batch(1))
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["grad_norm"] > 0 and engine.version == 1
    assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in lora_parameters(engine.model))
    assert any(p.abs().sum() > 0 for n, p in engine.model.named_parameters() if "lora_b" in n)
    lp = engine.compute_logprobs(synthetic_batch(1))
    assert all(x <= 0 and math.isfinite(x) for row in lp for x in row)


def saved_activation_bytes(engine: TorchEngine) -> int:
    """Bytes autograd keeps for backward in one training forward, parameters themselves excluded."""
    params = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    batch = pack(synthetic_batch(1, groups=4)).to(engine.device)
    engine.model.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        completion_logprobs(engine.model, batch)
    return sum(saved.values())


def test_bf16_lora_keeps_no_more_activations_than_full_finetuning(dense_dir: Path) -> None:
    lora = saved_activation_bytes(TorchEngine(make_spec(dense_dir, dtype="bfloat16")))
    full = saved_activation_bytes(TorchEngine(make_spec(dense_dir, dtype="bfloat16", full_finetune=True)))
    assert lora <= full, (lora, full)


def test_logprobs_match_a_plain_forward_and_reference_is_the_base(dense_dir: Path) -> None:
    engine = TorchEngine(make_spec(dense_dir, micro_batch_tokens=12))
    randomize_adapters(engine.model)
    batch = synthetic_batch(4)
    got = engine.compute_logprobs(batch)
    ref = engine.compute_logprobs(batch, reference=True)
    base = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    for rec, lp, rlp in zip(batch, got, ref, strict=True):
        ids = torch.tensor([rec.prompt_token_ids + rec.completion_token_ids])
        p = len(rec.prompt_token_ids)
        targets = torch.tensor(rec.completion_token_ids)
        for model, values in ((engine.model, lp), (base, rlp)):
            with torch.no_grad():
                out = model(input_ids=ids.to(next(model.parameters()).device)).logits[0].float().cpu()
                full = torch.log_softmax(out, -1)
            expected = full[p - 1: p - 1 + len(targets)].gather(-1, targets[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(values), expected, rtol=0, atol=1e-5)
    assert max(abs(a - b) for row, rrow in zip(got, ref, strict=True) for a, b in zip(row, rrow, strict=True)) > 1e-3


def test_decoupled_ppo_recomputes_the_proximal_policy(dense_dir: Path) -> None:
    loss = LossSpec(type="grpo", behavior_weight_cap=1.2)
    engine = TorchEngine(make_spec(dense_dir, loss=loss))
    batch = on_policy(engine, synthetic_batch(5))
    for rec in batch:  # sampled by an older policy that liked these tokens less
        rec.behavior_logprobs = [x - 0.5 for x in rec.behavior_logprobs]
    metrics = engine.forward_backward(batch)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # clipped against the proximal policy
    assert metrics["importance_weight_mean"] == pytest.approx(1.2, abs=1e-5)  # exp(0.5) capped at 1.2
    plain = TorchEngine(make_spec(dense_dir))
    m = plain.forward_backward(batch)
    assert m["ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-4) and m["importance_weight_mean"] == 1.0


def test_optim_step_needs_gradients_and_skips_non_finite_ones(dense_dir: Path) -> None:
    engine = TorchEngine(make_spec(dense_dir))
    with pytest.raises(EngineStateError, match="forward_backward"):
        engine.optim_step()
    engine.forward_backward(synthetic_batch(1))
    before = {n: p.detach().clone() for n, p in engine.named_trainable_parameters().items()}
    next(iter(engine.named_trainable_parameters().values())).grad[0, 0] = float("nan")
    metrics = engine.optim_step()
    assert metrics["skipped"] == 1.0 and engine.version == 0
    for n, p in engine.named_trainable_parameters().items():
        assert torch.equal(p, before[n]), n
    with pytest.raises(ValueError, match="completion token"):
        engine.forward_backward([])


def test_gradients_add_up_over_forward_backward_calls_and_lr_override(dense_dir: Path) -> None:
    engine = TorchEngine(make_spec(dense_dir))
    randomize_adapters(engine.model)
    engine.forward_backward(synthetic_batch(1))
    once = grads(engine)
    engine.forward_backward(synthetic_batch(1))
    twice = grads(engine)
    for n in once:
        torch.testing.assert_close(twice[n], 2 * once[n])
    assert engine.optim_step(lr=0.123)["lr"] == pytest.approx(0.123)


def test_a_steps_adam_settings_train_as_a_job_created_with_them_and_last_one_step(dense_dir: Path) -> None:
    """Tinker's optim_step(AdamParams(...)) sends betas, eps, weight decay and clipping with every step: a job
    stepped with them trains exactly as one created with them (its optimizer moments its own), and a later
    step that names none runs with the job's own settings again."""
    settings = {"beta1": 0.5, "beta2": 0.95, "eps": 1e-3, "weight_decay": 0.3, "max_grad_norm": 1e-3}
    made = TorchEngine(make_spec(dense_dir, optimizer=settings))
    stepped = TorchEngine(make_spec(dense_dir))
    plain = TorchEngine(make_spec(dense_dir))
    for seed in (1, 2):
        for engine in (made, stepped, plain):
            engine.forward_backward(synthetic_batch(seed))
        made.optim_step()
        assert stepped.optim_step(adam=AdamStep(**settings))["grad_norm"] > 1e-3  # so the clip bites
        plain.optim_step()
    for name, p in made.named_trainable_parameters().items():
        torch.testing.assert_close(stepped.named_trainable_parameters()[name], p, rtol=0, atol=0)
        assert not torch.equal(plain.named_trainable_parameters()[name], p), name
    stepped.forward_backward(synthetic_batch(3))
    stepped.optim_step()
    group = stepped.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.999), 1e-8, 0.0)
    with pytest.raises(ValueError, match=r"optimizer.beta2 must be in \[0, 1\)"):
        AdamStep(beta2=1.5).applied_to(OptimizerSpec())


def test_lr_schedule_warms_up_then_decays_by_cosine() -> None:
    opt = OptimizerSpec(learning_rate=1.0, warmup_steps=4, total_steps=12)
    assert [scheduled_lr(opt, s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert scheduled_lr(opt, 8) == pytest.approx(0.5)
    assert scheduled_lr(opt, 12) == pytest.approx(0.0) and scheduled_lr(opt, 50) == pytest.approx(0.0)
    assert scheduled_lr(OptimizerSpec(learning_rate=0.3), 1000) == 0.3


def test_export_adapter_loads_in_peft_with_equal_logits(dense_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    engine = TorchEngine(make_spec(dense_dir, lr=5e-2))
    for seed in (1, 2, 3):
        engine.train_step(synthetic_batch(seed, version=engine.version))
    adapted = logits(engine.model)
    base = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    assert (adapted - logits(base)).abs().max() > 1e-3  # training moved the policy
    out = engine.export_adapter(tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(base, out).eval()
    assert (logits(peft_model) - adapted).abs().max() <= 1e-4
    assert dict(engine.iter_adapter_tensors()).keys() == load_file(out / "adapter_model.safetensors").keys()


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_export_merged_loads_in_transformers_with_equal_logits(which: str, dense_dir: Path, moe_dir: Path,
                                                               tmp_path: Path) -> None:
    path = dense_dir if which == "dense" else moe_dir
    engine = TorchEngine(make_spec(path, lr=5e-2))
    for seed in (1, 2, 3):
        engine.train_step(synthetic_batch(seed, version=engine.version))
    adapted = logits(engine.model)
    assert (adapted - logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))).abs().max() > 1e-3
    out = engine.export_merged(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (logits(merged) - adapted).abs().max() <= 1e-4
    streamed = dict(engine.iter_merged_tensors())
    assert len(streamed) == len(list(engine.iter_merged_tensors()))


def test_moe_attention_only_adapter_loads_in_peft(moe_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    engine = TorchEngine(make_spec(moe_dir, lr=5e-2, lora=LoraConfig(rank=4, alpha=8, expert_mode="none")))
    for seed in (1, 2):
        engine.train_step(synthetic_batch(seed, version=engine.version))
    out = engine.export_adapter(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out).eval()
    assert (logits(peft_model) - logits(engine.model)).abs().max() <= 1e-4


def test_full_finetune_trains_every_parameter(dense_dir: Path) -> None:
    engine = TorchEngine(make_spec(dense_dir, lr=1e-3, full_finetune=True))
    assert engine.trainable_parameters == engine.total_parameters
    before = engine.model.model.embed_tokens.weight.detach().clone()
    engine.train_step(synthetic_batch(1))
    assert not torch.equal(before, engine.model.model.embed_tokens.weight)
    with pytest.raises(EngineStateError):
        engine.export_adapter("unused")
    with pytest.raises(ValueError, match="kl_coef"):
        make_spec(dense_dir, full_finetune=True, loss=LossSpec(kl_coef=0.1))


def test_warm_up_runs_the_model_and_leaves_every_step_unchanged(dense_dir: Path) -> None:
    """Dropout on, so the steps draw from the RNG the warm-up must hand back untouched."""
    spec = make_spec(dense_dir, lora=LoraConfig(rank=4, alpha=8, dropout=0.3))
    cold, warm = TorchEngine(spec), TorchEngine(spec)
    calls = []
    hook = warm.model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    rng_before = (torch.get_rng_state(), random.getstate())
    warm.warm_up()
    hook.remove()
    assert calls, "warm_up never ran the model"
    assert torch.equal(torch.get_rng_state(), rng_before[0]) and random.getstate() == rng_before[1]
    assert warm.version == 0 and all(p.grad is None for p in warm.named_trainable_parameters().values())
    for engine in (cold, warm):  # each engine seeded the global RNGs when built: start both from one state
        torch.manual_seed(7)
        random.seed(7)
        engine.metrics = [engine.train_step(synthetic_batch(s)) for s in (1, 2)]
    for key in ("loss", "grad_norm", "entropy"):
        assert [m[key] for m in warm.metrics] == [m[key] for m in cold.metrics], key
    for name, p in cold.named_trainable_parameters().items():
        assert torch.equal(p, warm.named_trainable_parameters()[name]), name
    warm.forward_backward(synthetic_batch(3))
    with pytest.raises(EngineStateError, match="discard"):
        warm.warm_up()
