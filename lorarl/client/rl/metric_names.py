"""The names of a run's metrics (metrics.jsonl, TensorBoard, W&B, the progress line): one scheme, defined here.

Every name is ``<source>/<quantity>``; the source says who measured it and over what:

    rollout/*   the step's samples, as the loop scored them: rollout/reward_mean, rollout/reward_std,
                rollout/accuracy (the share of samples whose reward is >= loop.success_reward, 1 by default),
                rollout/response_length_mean|max, rollout/truncated_fraction, rollout/zero_advantage_groups
    train/*     the trainer's step, its own metric names under train/: train/loss, train/entropy (the policy's
                entropy at the sampled tokens, averaged as the loss averages), train/kl_ref, train/version, ...
    eval/*      held-out greedy episodes: eval/accuracy (same rule as rollout/accuracy), eval/mean_reward, and
                eval/<value>/accuracy for each value of data.eval_by's column (e.g. each task of a mixed dataset)
    policy/*    the loop's checks of the served policy: policy/version_lag, policy/mismatch_alarm, policy/guard_*
    sync/*      publishing a version: sync/seconds, sync/bytes, sync/version
    distill/*   on-policy distillation, per teacher (a route's teacher, or "mixture"): distill/<teacher>/reverse_kl
                (the sampled tokens' mean log pi_behaviour - log pi_teacher), distill/<teacher>/reward_mean,
                distill/<teacher>/prompt_share; distill/teacher_seconds (the replicas' time scoring the step)

Three different KLs, so none is called plain "kl":

    train/kl_ref          KL from the policy to the reference (the base: adapters off), the loss's KL term;
                          present only when trainer.loss.kl_coef > 0 (only then does the trainer run the reference)
    train/rollout_kl_k3   the rollout-vs-trainer mismatch: k3 KL between the logprobs the rollout sampled with and
                          the trainer's for the same tokens (~0 on-policy; the progress line's "mismatch")
    distill/<teacher>/reverse_kl   KL from the policy to a teacher

The trainer names its metrics for itself (its TrainStep and Tinker answers say "kl"); ``train_metrics`` is where
the loop renames the ones whose bare name would be ambiguous in a run's log.
"""

from __future__ import annotations

from collections.abc import Mapping

REWARD_MEAN = "rollout/reward_mean"
REWARD_STD = "rollout/reward_std"
ACCURACY = "rollout/accuracy"
RESPONSE_LENGTH_MEAN = "rollout/response_length_mean"
RESPONSE_LENGTH_MAX = "rollout/response_length_max"
TRUNCATED_FRACTION = "rollout/truncated_fraction"
ZERO_ADVANTAGE_GROUPS = "rollout/zero_advantage_groups"
TOKENS_PER_S = "rollout/tokens_per_s"

ENTROPY = "train/entropy"
KL_REF = "train/kl_ref"
MISMATCH = "train/rollout_kl_k3"
VERSION = "train/version"

EVAL_ACCURACY = "eval/accuracy"
EVAL_MEAN_REWARD = "eval/mean_reward"

VERSION_LAG = "policy/version_lag"
MISMATCH_ALARM = "policy/mismatch_alarm"

TEACHER_SECONDS = "distill/teacher_seconds"


def eval_accuracy_of(value: str) -> str:
    """eval/<value>/accuracy: the held-out accuracy of the rows whose data.eval_by column holds ``value``."""
    return f"eval/{value}/accuracy"


def teacher_metric(teacher: str, quantity: str) -> str:
    """distill/<teacher>/<quantity>: reverse_kl, reward_mean, prompt_share."""
    return f"distill/{teacher}/{quantity}"


#: The trainer's step metrics that take another name in a run's log: what they are, not just their kind.
TRAINER_RENAMES = {"kl": "kl_ref"}


def train_metrics(values: Mapping[str, float]) -> dict[str, float]:
    """A trainer step's metrics as a run logs them: ``train/<name>``, the ambiguous ones renamed."""
    return {f"train/{TRAINER_RENAMES.get(k, k)}": v for k, v in values.items()}


def successes(rewards: list[float], success_reward: float) -> float:
    """The share of ``rewards`` that count as a success (>= ``success_reward``): what rollout/accuracy and
    eval/accuracy report. 0 for no samples."""
    return sum(1.0 for r in rewards if r >= success_reward) / max(len(rewards), 1)
