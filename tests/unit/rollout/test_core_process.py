"""How vLLM's engine core starts (lorarl/rollout/vllm/core_process.py): forked on CPU from a process that declared
itself fresh, spawned otherwise, and always as the caller asked where the caller set the variable."""

from __future__ import annotations

import pytest

from lorarl.rollout.vllm.core_process import ENV, start_method


@pytest.mark.parametrize(("device", "safe", "expected"), [
    ("cpu", True, "fork"),  # the rollout service: ~14 s of imports saved per child
    ("cpu", False, None),  # a test harness or benchmark beside other work: vLLM's spawn
    ("cuda", True, None),  # vLLM decides on CUDA (it forks unless CUDA is initialised)
    ("npu", True, None),
])
def test_fork_only_where_declared_safe_on_cpu(device: str, safe: bool, expected: str | None) -> None:
    assert start_method(device, {}, fork_safe=safe, threads=1) == expected


def test_a_process_running_other_threads_spawns_even_if_declared_safe() -> None:
    """The child would have only the forking thread: what the others held is lost there (a gRPC object on another
    thread's stack, freed in the child, spun forever joining its poller)."""
    assert start_method("cpu", {}, fork_safe=True, threads=2) is None


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_callers_own_setting_wins(method: str) -> None:
    assert start_method("cpu", {ENV: method}, fork_safe=method == "spawn", threads=1) == method


def test_a_value_vllm_does_not_take_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=f"{ENV}='forkserver'"):
        start_method("cpu", {ENV: "forkserver"}, fork_safe=True, threads=1)
