"""The served-policy check at the trainer's door (lorarl.trainer.service.validation.FingerprintRule): a trajectory
naming other weights for a version than the trainer published for it is refused, or flagged, as the job says."""

from __future__ import annotations

import pytest

from lorarl.trainer.engines.api import LimitsSpec, TrajectoryRecord
from lorarl.trainer.service.validation import FingerprintRule, InvalidTrajectory, TrajectoryBuffer


def record(fingerprints: dict[int, str]) -> TrajectoryRecord:
    return TrajectoryRecord([1, 2], [3, 4], [-1.0, -1.0], [1, 2], 1.0, "g", id="t", fingerprints=fingerprints)


def buffer(action: str) -> TrajectoryBuffer:
    rule = FingerprintRule(action=action)
    rule.record(1, ["xxh64:a"])
    rule.record(2, ["xxh64:b", "xxh64:b-merged"])  # a merged job: its adapter's and its merged weights' digests
    return TrajectoryBuffer(16, LimitsSpec(), fingerprints=rule)


def test_the_published_weights_pass_and_others_are_refused_by_name() -> None:
    b = buffer("refuse")
    b.push(record({1: "xxh64:a", 2: "xxh64:b-merged"}), current_version=2)
    b.push(record({}), current_version=2)  # nothing claimed (an SDK's own trajectory): nothing to check
    b.push(record({7: "xxh64:zz"}), current_version=2)  # a version this trainer never published here: unchecked
    with pytest.raises(InvalidTrajectory) as err:
        b.push(record({1: "xxh64:a", 2: "xxh64:stale"}), current_version=2)
    assert err.value.field == "policy_fingerprints"
    assert "version 2 was served with weights xxh64:stale" in str(err.value)
    assert len(b) == 3


def test_flag_accepts_and_counts_and_off_does_not_look() -> None:
    b = buffer("flag")
    b.push(record({2: "xxh64:stale"}), current_version=2)
    assert len(b) == 1 and b.fingerprints.flagged == 1
    off = buffer("off")
    off.push(record({2: "xxh64:stale"}), current_version=2)
    assert off.fingerprints.flagged == 0 and len(off) == 1


def test_only_the_last_versions_are_remembered() -> None:
    rule = FingerprintRule(keep=3)
    for v in range(1, 8):
        rule.record(v, [f"xxh64:{v}"])
    assert sorted(rule.published) == [5, 6, 7]
