"""Reward functions that fail: scored 0 and counted (data.reward_errors=zero), or the run ends (fail)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path

import pytest

from lorarl.client.job.config import load_job_config
from lorarl.client.job.datasets import Example
from lorarl.client.job.rewards import GuardedReward, RewardError
from lorarl.client.rl.loop import RLLoop
from lorarl.client.rl.run_log import RunLog
from lorarl.common.config import ConfigError
from tests.unit.clients.test_loop_async import Recorder

ROOT = Path(__file__).resolve().parents[3]


def flaky(text: str, answer: str) -> float:
    if answer == "boom":
        raise KeyError("no such field")
    if answer == "nan":
        return math.nan
    return float(text == answer)


def test_a_failing_sample_scores_zero_is_counted_and_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    reward = GuardedReward(flaky, "zero", name="mine:flaky")
    with caplog.at_level(logging.WARNING, logger="lorarl.client.job.rewards"):
        scores = [reward("1", a) for a in ("1", "boom", "nan", "boom", "2")]
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert reward.errors == 3
    (record,) = caplog.records
    assert "mine:flaky" in record.getMessage() and "KeyError" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is KeyError  # the first traceback, once


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_non_finite_reward_is_a_failure(value: float) -> None:
    reward = GuardedReward(lambda text, answer: value, "zero")
    assert reward("x", "y") == 0.0 and reward.errors == 1


def test_fail_ends_the_run_with_the_functions_error() -> None:
    reward = GuardedReward(flaky, "fail", name="mine:flaky")
    assert reward("1", "1") == 1.0
    with pytest.raises(RewardError, match=r"reward 'mine:flaky' failed: KeyError") as raised:
        reward("1", "boom")
    assert isinstance(raised.value.__cause__, KeyError)
    with pytest.raises(RewardError, match="returned nan"):
        reward("1", "nan")


def test_an_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="reward_errors"):
        GuardedReward(flaky, "ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reward_errors"):
        load_job_config(str(ROOT / "examples/demo.yaml"), ["data.reward_errors=skip"])


def test_metrics_jsonl_stays_valid_json_with_non_finite_values(tmp_path: Path) -> None:
    log = RunLog(tmp_path, total_steps=1, tensorboard=False, progress=False)
    log({"step": 0.0, "train/loss": math.nan, "train/grad_norm": math.inf, "rollout/reward_mean": 0.5})
    log.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    row = json.loads(line, parse_constant=refuse)
    assert row["train/loss"] is None and row["train/grad_norm"] is None and row["rollout/reward_mean"] == 0.5


def test_the_loop_counts_each_steps_failed_samples_and_carries_on() -> None:
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"),
                          ["loop.steps=3", "loop.prompts_per_step=2", "rollout.group_size=2", "loop.mode=sync",
                           "loop.policy_guard.every=0"])  # stub services: the guard has its own tests
    examples = [Example(f"q{i}", "boom" if i % 2 else "1") for i in range(8)]
    stub = Recorder(generate_s=0.0, train_s=0.0)
    rows: list[dict] = []
    loop = RLLoop(cfg, trainer=stub, rollout=stub, reward=flaky, train=examples, test=examples[:2],
                  on_metrics=rows.append)
    asyncio.run(asyncio.wait_for(loop.run(), timeout=20))
    history = [row for row in loop.state.history if "rollout/reward_errors" in row]
    assert len(history) == 3
    # every step holds one 'boom' prompt of two, with two completions each
    assert [row["rollout/reward_errors"] for row in history] == [2.0, 2.0, 2.0]
    assert all(row["rollout/reward_mean"] == 0.5 for row in history)
    evals = [row for row in rows if "eval/reward_errors" in row]
    assert evals and all(row["eval/reward_errors"] == 1.0 for row in evals)  # one 'boom' of the two held out
