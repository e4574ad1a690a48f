"""The OpenMP binding a multi-worker vLLM CPU engine gets (lorarl/rollout/vllm/cpu_binding.py)."""

from __future__ import annotations

import pytest

from lorarl.rollout.vllm.cpu_binding import BIND_ENV, apply_thread_binding, thread_binding, worker_cpu_groups


def test_cpus_split_into_contiguous_equal_groups() -> None:
    assert thread_binding([0, 1], 2) == "0|1"
    assert thread_binding([3, 0, 1, 2, 4, 5, 6, 7], 2) == "0-3|4-7"
    assert worker_cpu_groups([0, 1, 2], 2) == [[0], [1]]  # the remainder stays free
    assert thread_binding([2, 5, 6, 9], 4) == "2|5|6|9"


def test_too_few_cpus_names_the_settings() -> None:
    with pytest.raises(ValueError, match=r"2 vLLM CPU workers need a CPU each, but only 1 \(0\).*tensor_parallel_size"):
        worker_cpu_groups([0], 2)


def test_set_once_for_several_workers_and_the_callers_value_wins() -> None:
    env: dict[str, str] = {}
    assert apply_thread_binding([0, 1], 1, env) is None and env == {}
    assert apply_thread_binding([0, 1], 2, env) == "0|1" and env == {BIND_ENV: "0|1"}
    mine = {BIND_ENV: "1|0"}
    assert apply_thread_binding([0, 1], 2, mine) == "1|0" and mine == {BIND_ENV: "1|0"}
