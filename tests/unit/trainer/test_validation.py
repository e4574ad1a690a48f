"""Trajectory validation names the offending field; the buffer is bounded and loses nothing."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest

from lorarl.trainer.engines.api import LimitsSpec, OptimizerSpec, TrainingSpec, TrajectoryRecord
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.service.validation import (
    LOGPROB_TOLERANCE,
    BufferFullError,
    InvalidTrajectory,
    TrajectoryBuffer,
    validate_trajectory,
)

VOCAB = 97
LIMITS = LimitsSpec(max_sequence_tokens=16, max_buffered_trajectories=4)


def good(group: str = "g", reward: float = 1.0) -> TrajectoryRecord:
    return TrajectoryRecord([1, 2, 3], [4, 5, 6], [-0.1, -2.0, 0.0], [0, 1, 2], reward, group, "stop", "t")


def check(rec: TrajectoryRecord, version: int = 2) -> None:
    validate_trajectory(rec, VOCAB, version, LIMITS)


def test_valid_trajectory_passes() -> None:
    check(good())
    check(replace(good(), behavior_logprobs=[-0.1, LOGPROB_TOLERANCE, 0.0]))  # rounding noise above 0


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"completion_token_ids": []}, "completion_token_ids", "empty"),
    ({"prompt_token_ids": []}, "prompt_token_ids", "empty"),
    ({"behavior_logprobs": [-0.1, -0.2]}, "behavior_logprobs", "2 entries for 3"),
    ({"token_versions": [0, 0, 0, 0]}, "token_versions", "4 entries for 3"),
    ({"completion_token_ids": [4, 97, 6]}, "completion_token_ids", "outside the vocabulary"),
    ({"completion_token_ids": [4, -1, 6]}, "completion_token_ids", "outside the vocabulary"),
    ({"prompt_token_ids": [1000]}, "prompt_token_ids", "outside the vocabulary"),
    ({"behavior_logprobs": [-0.1, math.nan, 0.0]}, "behavior_logprobs", "finite"),
    ({"behavior_logprobs": [-0.1, -math.inf, 0.0]}, "behavior_logprobs", "finite"),
    ({"behavior_logprobs": [-0.1, 0.5, 0.0]}, "behavior_logprobs", "<= 0"),
    ({"token_versions": [0, 3, 2]}, "token_versions", "ahead"),
    ({"token_versions": [0, -1, 2]}, "token_versions", "negative"),
    ({"reward": math.inf}, "reward", "finite"),
    ({"reward": math.nan}, "reward", "finite"),
    ({"prompt_token_ids": [1] * 14}, "completion_token_ids", "max_sequence_tokens"),
    ({"finish_reason": "exploded"}, "finish_reason", "expected one of"),
])
def test_invalid_trajectories_name_their_field(change: dict, field: str, words: str) -> None:
    with pytest.raises(InvalidTrajectory, match=words) as err:
        check(replace(good(), **change))
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_buffer_keeps_accepted_items_when_others_are_rejected_and_refuses_when_full() -> None:
    buf = TrajectoryBuffer(VOCAB, LIMITS)
    bad = replace(good(), reward=math.nan)
    statuses = buf.push_many([good("a"), bad, good("a"), good("b")], current_version=2)
    assert [s is None for s in statuses] == [True, False, True, True]
    assert isinstance(statuses[1], InvalidTrajectory) and statuses[1].field == "reward"
    assert len(buf) == 3
    statuses = buf.push_many([good("c"), good("c")], current_version=2)
    assert statuses[0] is None and isinstance(statuses[1], BufferFullError)
    assert len(buf) == 4
    with pytest.raises(BufferFullError, match="full"):
        buf.push(good("d"), current_version=2)
    assert [r.group_id for r in buf.pop_batch()] == ["a", "a", "b", "c"]
    assert len(buf) == 0


def test_pop_batch_takes_whole_groups_oldest_first() -> None:
    buf = TrajectoryBuffer(VOCAB, LimitsSpec(16, 10))
    for g in ["a", "b", "a", "c", "b", "c", "c"]:
        buf.push(good(g), current_version=2)
    assert [r.group_id for r in buf.pop_batch(4)] == ["a", "b", "a", "b"]
    assert [r.group_id for r in buf.pop_batch(1)] == ["c", "c", "c"]  # a bigger first group comes whole
    assert len(buf) == 0


def test_restore_puts_a_failed_batch_back_in_front() -> None:
    buf = TrajectoryBuffer(VOCAB, LIMITS)
    buf.push(good("a"), 2)
    buf.push(good("b"), 2)
    batch = buf.pop_batch(1)
    buf.restore(batch)
    assert [r.group_id for r in buf.pop_batch()] == ["a", "b"]


def test_buffer_never_exceeds_capacity_under_concurrent_pushes() -> None:
    buf = TrajectoryBuffer(VOCAB, LimitsSpec(16, 50))
    results: list[object] = []

    def worker() -> None:
        results.extend(buf.push_many([good(str(i)) for i in range(20)], 2))

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(buf) == 50
    assert sum(r is None for r in results) == 50 and sum(isinstance(r, BufferFullError) for r in results) == 50


@pytest.mark.parametrize(("build", "message"), [
    (lambda: OptimizerSpec(learning_rate=0), r"optimizer.learning_rate must be in \(0, 10\]"),
    (lambda: OptimizerSpec(beta2=1.0), "optimizer.beta2"),
    (lambda: OptimizerSpec(micro_batch_tokens=-1), "optimizer.micro_batch_tokens"),
    (lambda: OptimizerSpec(max_grad_norm=-1), "optimizer.max_grad_norm"),
    (lambda: LimitsSpec(max_sequence_tokens=0), "limits.max_sequence_tokens"),
    (lambda: TrainingSpec(base_model_path=""), "base_model_path"),
    (lambda: TrainingSpec(base_model_path="m", device="tpu"), "device"),
    (lambda: TrainingSpec(base_model_path="m", dtype="float16"), "dtype"),
    (lambda: TrainingSpec(base_model_path="m", engine="jax"), "engine"),
    (lambda: TrainingSpec(base_model_path="m", lora=LoraConfig(rank=0)), "lora.rank"),
])
def test_job_spec_validation_names_the_dotted_field(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
