"""How vLLM's engine core starts (lorarl/rollout/vllm/core_process.py): forked on CPU from a process that declared
itself fresh, spawned otherwise, and always as the caller asked where the caller set the variable."""

from __future__ import annotations

import pytest

from lorarl.rollout.vllm.core_process import ENV, start_method, starting_children


@pytest.mark.parametrize(("device", "safe", "expected"), [
    ("cpu", True, "fork"),  # the rollout service: ~14 s of imports saved per child
    ("cpu", False, None),  # a test harness or benchmark beside other work: vLLM's spawn
    ("cuda", True, None),  # vLLM decides on CUDA (it forks unless CUDA is initialised)
    ("npu", True, None),
])
def test_fork_only_where_declared_safe_on_cpu(device: str, safe: bool, expected: str | None) -> None:
    assert start_method(device, {}, fork_safe=safe, process_group=False) == expected


def test_a_process_in_a_torch_distributed_group_spawns() -> None:
    """A forked child would inherit the group (a world of the parent's size) and vLLM would join it."""
    assert start_method("cpu", {}, fork_safe=True, process_group=True) is None


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_callers_own_setting_wins(method: str) -> None:
    assert start_method("cpu", {ENV: method}, fork_safe=method == "spawn") == method


def test_a_value_vllm_does_not_take_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=f"{ENV}='forkserver'"):
        start_method("cpu", {ENV: "forkserver"}, fork_safe=True)


def test_a_fork_freezes_the_parents_objects_until_the_children_are_up() -> None:
    """What the child collects never reaches the parent's objects (a gRPC object freed in a forked child spun
    forever joining a poller thread that was not there); a spawn leaves the collector alone. Afterwards the
    variable is the caller's again, so the next engine in the process decides afresh."""
    import gc

    environ: dict[str, str] = {}
    with starting_children("fork", None, environ):
        assert environ[ENV] == "fork" and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and ENV not in environ
    with starting_children("spawn", None, environ):
        assert environ[ENV] == "spawn" and gc.get_freeze_count() == 0
    environ[ENV] = "spawn"  # as vLLM's CPU config leaves it
    with starting_children(None, None, environ):
        assert environ[ENV] == "spawn"  # None: whatever vLLM set stays while its children start
    assert ENV not in environ
    with starting_children("spawn", "spawn", environ):
        pass
    assert environ[ENV] == "spawn"  # the operator's own setting stays
