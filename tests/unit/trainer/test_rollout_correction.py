"""Rollout correction (lorarl.trainer.rl.correction) against values computed by hand, its spec's checks, and
what rejection does to a real engine's step: a rejected sequence leaves the loss and its denominator."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lorarl.contract.errors import SpecError
from lorarl.contract.training import CorrectionSpec, LossSpec, MegatronSpec, TrainingSpec
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.batching import micro_batches
from lorarl.trainer.rl.correction import correct, current_kl
from lorarl.trainer.rl.losses import LossInputs, policy_loss
from tests.unit.trainer.engine_utils import count_calls, make_spec, synthetic_batch

# rho (trainer over rollout) per token: row 0 [3, 0.5, 1], row 1 [1.5, 1] and a padding position.
RHO = torch.tensor([[3.0, 0.5, 1.0], [1.5, 1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -3.0, -9.0]])
TRAIN = ROLLOUT + RHO.log()


def run(**spec: object) -> tuple[list[list[float]], list[list[float]], dict[str, float]]:
    c = correct(TRAIN, ROLLOUT, MASK, CorrectionSpec(**spec))  # type: ignore[arg-type]
    return c.weight.tolist(), c.keep.tolist(), c.metrics


def approx(rows: list[list[float]]) -> object:
    return [pytest.approx(r, rel=1e-5, abs=1e-6) for r in rows]


def test_the_monitor_alone_changes_nothing() -> None:
    weight, keep, m = run()
    assert weight == MASK.tolist() and keep == MASK.tolist()
    # k1 = mean(log mu - log pi_old) over the 5 policy tokens; k3 = mean(rho - 1 - log rho)
    assert m["rollout_kl_k1"] == pytest.approx(-(math.log(3) + math.log(0.5) + math.log(1.5)) / 5, rel=1e-5)
    k3 = (3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5)) + (1.5 - 1 - math.log(1.5))
    assert m["rollout_kl_k3"] == pytest.approx(k3 / 5, rel=1e-5)
    assert m["rollout_token_past_fraction"] == pytest.approx(1 / 5)  # only 3 is outside [1/2, 2]
    assert m["rollout_seq_past_fraction"] == 0.0  # both products are 1.5
    assert m["rollout_is_weight_mean"] == 1.0 and m["rollout_masked_token_fraction"] == 0.0


def test_token_tis_truncates_each_token_at_c() -> None:
    weight, keep, m = run(rollout_is="token")
    assert weight == approx([[2.0, 0.5, 1.0], [1.5, 1.0, 0.0]]) and keep == MASK.tolist()
    assert m["rollout_is_weight_mean"] == pytest.approx(6.0 / 5)


def test_sequence_tis_gives_every_token_the_truncated_product() -> None:
    weight, _, _ = run(rollout_is="sequence")
    assert weight == approx([[1.5, 1.5, 1.5], [1.5, 1.5, 0.0]])
    weight, _, m = run(rollout_is="sequence", rollout_is_threshold=1.2)
    assert weight == approx([[1.2, 1.2, 1.2], [1.2, 1.2, 0.0]])
    assert m["rollout_seq_past_fraction"] == 1.0  # past C = 1.2 both


def test_icepop_zeroes_weights_outside_the_band_and_keeps_the_rest_untruncated() -> None:
    weight, keep, _ = run(rollout_is="token", rollout_is_threshold_low=0.6)
    assert weight == approx([[0.0, 0.0, 1.0], [1.5, 1.0, 0.0]])
    assert keep == MASK.tolist()  # zero weight, still in the denominator
    weight, _, _ = run(rollout_is="sequence", rollout_is_threshold=1.4, rollout_is_threshold_low=0.5)
    assert weight == approx([[0.0] * 3, [0.0] * 3])


def test_token_rejection_drops_tokens_outside_its_bounds() -> None:
    _, keep, m = run(rollout_rs="token")
    assert keep == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]  # bounds are inclusive: 0.5 stays
    assert m["rollout_masked_token_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_masked_seq_fraction"] == 0.0


def test_sequence_mis_drops_whole_sequences_by_their_product() -> None:
    _, keep, _ = run(rollout_rs="sequence")
    assert keep == MASK.tolist()
    _, keep, m = run(rollout_is="sequence", rollout_rs="sequence", rollout_rs_threshold=1.2)
    assert keep == [[0.0] * 3, [0.0] * 3]
    assert m["rollout_masked_seq_fraction"] == 1.0 and m["rollout_masked_token_fraction"] == 1.0


def test_geometric_rejection_reads_the_mean_log_ratio() -> None:
    # geometric means: 1.5 ** (1/3) = 1.145, 1.5 ** (1/2) = 1.225
    _, keep, _ = run(rollout_rs="geometric")  # default [0.999, 1.001]: both out
    assert keep == [[0.0] * 3, [0.0] * 3]
    _, keep, m = run(rollout_rs="geometric", rollout_rs_threshold=1.2, rollout_rs_threshold_low=0.9)
    assert keep == [[1.0] * 3, [0.0] * 3]
    assert m["rollout_masked_seq_fraction"] == 0.5


def test_k3_rejection_reads_the_mean_k3_of_a_sequence() -> None:
    # mean k3: row 0 (0.901 + 0.193 + 0) / 3 = 0.365; row 1 (0.095 + 0) / 2 = 0.047
    _, keep, _ = run(rollout_rs="k3", rollout_rs_threshold=0.1)
    assert keep == [[0.0] * 3, [1.0, 1.0, 0.0]]
    _, keep, _ = run(rollout_rs="k3")  # default 0.01: both out
    assert keep == [[0.0] * 3, [0.0] * 3]


def test_log_ratios_are_bounded_before_exp() -> None:
    c = correct(torch.tensor([[0.0]]), torch.tensor([[-1000.0]]), torch.ones(1, 1), CorrectionSpec())
    assert math.isfinite(c.metrics["rollout_kl_k3"]) and c.metrics["rollout_kl_k1"] == -20.0


def test_the_loss_weighs_and_rejects_as_the_correction_says() -> None:
    adv = torch.tensor([1.0, 1.0])
    spec = LossSpec(type="dapo", rollout_correction=CorrectionSpec(rollout_is="token", rollout_rs="token"))
    logp = TRAIN.clone().requires_grad_(True)
    loss, m = policy_loss(LossInputs(logp=logp, mask=MASK, advantages=adv, behavior_logp=ROLLOUT,
                                     proximal_logp=TRAIN), spec)
    loss.backward()
    # ratio to proximal is 1 everywhere (unclipped): d loss / d logp_t = -A * w_t / kept tokens, rejected 0
    kept = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weight = torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, 0.0]])
    torch.testing.assert_close(logp.grad, -(weight * kept) / kept.sum())
    assert m["tokens"] == 4.0 and m["rollout_masked_token_fraction"] == pytest.approx(0.2)


# ---------------------------------------------------------------- the spec


@pytest.mark.parametrize(("settings", "field"), [
    ({"rollout_is": "tokens"}, "rollout_is"),
    ({"rollout_rs": "product"}, "rollout_rs"),
    ({"rollout_is": "token", "rollout_is_threshold": 1.0}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": float("inf")}, "rollout_is_threshold"),
    ({"rollout_is_threshold_low": 0.5}, "rollout_is_threshold_low"),
    ({"rollout_is": "token", "rollout_is_threshold_low": 1.0}, "rollout_is_threshold_low"),
    ({"rollout_rs_threshold": 2.0}, "rollout_rs_threshold"),
    ({"rollout_rs_threshold_low": 0.5}, "rollout_rs_threshold_low"),
    ({"rollout_rs": "k3", "rollout_rs_threshold_low": 0.001}, "rollout_rs_threshold_low"),
    ({"rollout_rs": "sequence", "rollout_rs_threshold": 0.0}, "rollout_rs_threshold"),
    ({"rollout_rs": "sequence", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_low": 2.0},
     "rollout_rs_threshold_low"),
])
def test_bad_settings_name_their_field(settings: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        CorrectionSpec(**settings)
    assert err.value.path == f"loss.rollout_correction.{field}"


def test_defaults_and_their_proto_form_round_trip() -> None:
    spec = CorrectionSpec(rollout_is="sequence", rollout_rs="geometric")
    assert spec.rs_bounds == (0.999, 1.001) and CorrectionSpec(rollout_rs="k3").rs_bounds == (None, 0.01)
    loss = LossSpec(rollout_correction=spec)
    back = LossSpec.from_proto(loss.to_proto()).rollout_correction
    assert (back.rollout_is, back.rollout_rs, back.rollout_is_threshold) == ("sequence", "geometric", 2.0)
    assert back.rs_bounds == (0.999, 1.001)
    assert LossSpec.from_proto(LossSpec().to_proto()).rollout_correction == CorrectionSpec()


def test_correction_turns_on_decoupled_ppo_and_replaces_the_weight_cap(dense_dir: Path) -> None:
    plain = make_spec(dense_dir)
    assert not plain.decoupled()
    corrected = replace(plain, loss=LossSpec(rollout_correction=CorrectionSpec(rollout_is="token")))
    assert corrected.decoupled() and corrected.loss.weight_cap == 0.0
    with pytest.raises(SpecError, match="behavior_weight_cap"):
        LossSpec(behavior_weight_cap=5.0, rollout_correction=CorrectionSpec(rollout_is="token"))
    with pytest.raises(SpecError, match="rollout_correction"):
        LossSpec(type="importance_sampling", rollout_correction=CorrectionSpec(rollout_rs="token"))
    with pytest.raises(SpecError, match="pipeline_parallel_size"):
        TrainingSpec(base_model_path=str(dense_dir), engine="megatron", megatron=MegatronSpec(pipeline_parallel_size=2),
                     loss=LossSpec(rollout_correction=CorrectionSpec(rollout_rs="sequence")))


# ---------------------------------------------------------------- a real step


def on_policy(engine: TorchEngine, seed: int, wild: int) -> list:
    """A batch whose rollout logprobs are the trainer's own, except the first ``wild`` records' (rho = e^3)."""
    batch = synthetic_batch(seed, groups=3, group_size=3)
    for i, (record, logp) in enumerate(zip(batch, engine.compute_logprobs(batch), strict=True)):
        record.behavior_logprobs = [v - 3.0 if i < wild else v for v in logp]
    return batch


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_rejected_sequence_leaves_the_loss_and_its_denominator(dense_dir: Path, loss_type: str) -> None:
    """Rejection of a whole group trains exactly what the batch without that group trains (seq-mean and
    token-mean alike, over several micro-batches); without rejection the same batch trains something else."""
    rejecting = LossSpec(type=loss_type, rollout_correction=CorrectionSpec(rollout_rs="sequence"))
    plain = LossSpec(type=loss_type)

    def step(loss: LossSpec, drop_first_group: bool) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
        engine = TorchEngine.create(make_spec(dense_dir, loss=loss, seed=5, micro_batch_tokens=30,
                                              recompute_proximal=True))
        batch = on_policy(engine, seed=1, wild=3)
        metrics = engine.train_step(batch[3:] if drop_first_group else batch)
        wild_tokens = sum(len(r.completion_token_ids) for r in batch[:3])
        return {n: p.detach().clone() for n, p in engine.named_trainable_parameters().items()}, metrics, wild_tokens

    rejected, metrics, wild_tokens = step(rejecting, drop_first_group=False)
    without, _, _ = step(plain, drop_first_group=True)
    kept_anyway, _, _ = step(plain, drop_first_group=False)
    assert metrics["rollout_masked_seq_fraction"] == pytest.approx(3 / 9)
    # the monitor sees every token, rejected ones too: log mu - log pi_old is 3 on the wild ones, 0 elsewhere
    assert metrics["rollout_kl_k1"] == pytest.approx(-3.0 * wild_tokens / metrics["tokens"], rel=1e-4)
    assert metrics["loss_tokens"] == metrics["tokens"] - wild_tokens
    for name, tensor in rejected.items():
        torch.testing.assert_close(tensor, without[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(t, kept_anyway[n], atol=1e-6) for n, t in rejected.items())


def test_rejection_reads_each_micro_batch_once_before_the_step(dense_dir: Path) -> None:
    engine = TorchEngine.create(make_spec(dense_dir, loss=LossSpec(
        rollout_correction=CorrectionSpec(rollout_rs="token")), micro_batch_tokens=30))
    batch = on_policy(engine, seed=2, wild=0)
    passes = count_calls(engine.rl, "logprobs_no_grad")
    metrics = engine.train_step(batch)
    assert passes[0] == len(micro_batches([r.num_tokens for r in batch], 30)) > 1
    assert metrics["rollout_masked_token_fraction"] == 0.0
    assert metrics["rollout_kl_k3"] == pytest.approx(0.0, abs=1e-6)  # the rollout's logprobs are the trainer's


def test_the_current_tokens_kl_leaves_out_stale_tokens() -> None:
    """Row 1 (rho 1.5 and 1) was sampled by the trainer's own version, row 0 by an older one: the current KL
    is row 1's alone, and a batch with no current token reports none."""
    current = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # the padding position counts nowhere
    m = correct(TRAIN, ROLLOUT, MASK, CorrectionSpec(), current).metrics
    assert m["rollout_current_token_fraction"] == pytest.approx(2 / 5)
    current_kl(m)
    assert m["rollout_kl_k3_current"] == pytest.approx((1.5 - 1 - math.log(1.5)) / 2, rel=1e-5)
    assert "rollout_kl_k3_current_share" not in m
    none = correct(TRAIN, ROLLOUT, MASK, CorrectionSpec(), torch.zeros_like(MASK)).metrics
    current_kl(none)
    assert none["rollout_current_token_fraction"] == 0.0 and "rollout_kl_k3_current" not in none


def test_a_steps_current_kl_reads_only_the_tokens_of_the_trainers_version(dense_dir: Path) -> None:
    """After one step (version 1), wild records sampled at version 0 move the step's KL but not its current
    KL; a batch all of version 0 has no current KL."""
    engine = TorchEngine.create(make_spec(dense_dir, micro_batch_tokens=30))
    engine.train_step(synthetic_batch(9))
    assert engine.version == 1
    batch = on_policy(engine, seed=3, wild=3)
    for i, record in enumerate(batch):
        record.token_versions = [0 if i < 3 else 1] * len(record.completion_token_ids)
    metrics = engine.train_step(batch)
    assert metrics["rollout_kl_k3"] > 0.1
    assert metrics["rollout_kl_k3_current"] == pytest.approx(0.0, abs=1e-6)
    assert 0 < metrics["rollout_current_token_fraction"] < 1
    for record in batch:
        record.token_versions = [0] * len(record.completion_token_ids)
    assert "rollout_kl_k3_current" not in engine.train_step(batch)
