"""The mismatch alarm: a rollout-vs-trainer KL rising step after step at a flat learning rate, or past a ceiling."""

from __future__ import annotations

import logging

import pytest

from lorarl.client.job.config import MismatchAlarmSection
from lorarl.client.rl.mismatch import MismatchAlarm, MismatchAlarmError


def feed(alarm: MismatchAlarm, kls: list[float], lrs: list[float] | None = None) -> list[float]:
    """The ``policy/mismatch_alarm`` value of each step."""
    out = []
    for step, kl in enumerate(kls, 1):
        metrics = {"step": float(step), "train/rollout_kl_k3_current": kl,
                   "train/lr": (lrs or [1e-3] * len(kls))[step - 1]}
        alarm.observe(metrics)
        out.append(metrics["policy/mismatch_alarm"])
    return out


def test_a_kl_climbing_at_a_flat_learning_rate_fires(caplog: pytest.LogCaptureFixture) -> None:
    alarm = MismatchAlarm(MismatchAlarmSection(window=3, growth=4.0))
    with caplog.at_level(logging.WARNING):
        fired = feed(alarm, [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2])
    assert fired == [0, 0, 0, 1, 1]
    assert "rose 3 steps in a row" in caplog.text and "(8.0x)" in caplog.text


@pytest.mark.parametrize(("kls", "lrs"), [
    ([1e-3, 2e-3, 1.5e-3, 8e-3, 1.6e-2], None),  # not rising every step
    ([1e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.4e-3], None),  # rising, but only 1.3x
    ([1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2], [1e-4, 2e-4, 3e-4, 4e-4, 5e-4]),  # the learning rate moved (warm-up)
    ([1e-9, 2e-9, 4e-9, 8e-9, 1.6e-8], None),  # below the floor: float noise
])
def test_learning_and_noise_do_not_fire(kls: list[float], lrs: list[float] | None) -> None:
    assert feed(MismatchAlarm(MismatchAlarmSection(window=3, growth=4.0)), kls, lrs) == [0.0] * 5


def test_a_ceiling_fires_at_once_and_fail_ends_the_run() -> None:
    assert feed(MismatchAlarm(MismatchAlarmSection(max_kl=0.01)), [0.001, 0.02]) == [0, 1]
    alarm = MismatchAlarm(MismatchAlarmSection(max_kl=0.01, action="fail"))
    with pytest.raises(MismatchAlarmError, match=r"step 2: rollout-vs-trainer KL 0\.02 is above"):
        feed(alarm, [0.001, 0.02])


def test_window_zero_turns_the_growth_rule_off() -> None:
    assert feed(MismatchAlarm(MismatchAlarmSection(window=0)), [1e-3, 1e-2, 1e-1, 1.0]) == [0.0] * 4


def test_steps_without_current_tokens_neither_fire_nor_break_the_run() -> None:
    """The all-token KL (stale tokens hold the policy's own movement) rising 40x is no alarm; a step with no
    current-token KL leaves the window as it was."""
    alarm = MismatchAlarm(MismatchAlarmSection(window=3, growth=4.0))
    fired = []
    for step, kl in enumerate([1e-3, 4e-3, 1e-2, 2e-2, 4e-2], 1):
        metrics = {"step": float(step), "train/rollout_kl_k3": kl, "train/lr": 1e-3}
        alarm.observe(metrics)
        fired.append(metrics["policy/mismatch_alarm"])
    assert fired == [0.0] * 5
    assert feed(alarm, [1e-3, 2e-3, 4e-3, 8e-3]) == [0, 0, 0, 1]
