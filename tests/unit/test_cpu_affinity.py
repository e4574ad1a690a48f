"""CPU lists and process pinning (lorarl/common/cpu_affinity.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lorarl.common.config import ConfigError, from_dict
from lorarl.common.cpu_affinity import (
    available_cpus,
    check_cpus,
    cpu_list,
    format_cpu_list,
    machine_cpus,
    parse_cpu_list,
)
from lorarl.common.server_config import ServerConfig
from lorarl.rollout.config import RolloutSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("text", "cpus"), [("1", [1]), ("0-3,8", [0, 1, 2, 3, 8]), (" 5 , 2-3", [2, 3, 5]),
                                           ("4,4,3-4", [3, 4])])
def test_cpu_lists_parse_and_format_like_taskset(text: str, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert cpu_list(text) is None


def test_format_merges_runs() -> None:
    assert format_cpu_list([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert format_cpu_list([5]) == "5"


@pytest.mark.parametrize("text", ["a", "1-", "3-1", "1,,2", "-1", "0x1"])
def test_bad_cpu_lists_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(text)
    assert "CPU" in (cpu_list(text) or "")


def test_cpus_the_machine_lacks_are_refused_by_name() -> None:
    beyond = max(machine_cpus()) + 1
    with pytest.raises(ValueError, match=f"CPUs {beyond} are not available here .this machine has CPUs"):
        check_cpus([beyond])
    with pytest.raises(ValueError, match="empty"):
        check_cpus([])
    assert check_cpus(available_cpus()[:1]) == available_cpus()[:1]


def test_config_keys_are_checked_at_load() -> None:
    beyond = max(machine_cpus()) + 1
    with pytest.raises(ConfigError, match="cpus"):
        from_dict(ServerConfig, {"cpus": "2-1"}).validate()
    with pytest.raises(ConfigError, match=f"cpus: CPUs {beyond} are not available"):
        from_dict(ServerConfig, {"cpus": str(beyond)}).validate()
    with pytest.raises(ConfigError, match="engine_cpus: pins vLLM's engine core; engine is 'hf'"):
        from_dict(RolloutSettings, {"engine": "hf", "engine_cpus": "0"}).validate()
    with pytest.raises(ConfigError, match=f"engine_cpus: CPUs {beyond} are not available"):
        from_dict(RolloutSettings, {"engine_cpus": str(beyond)}).validate()
    from_dict(RolloutSettings, {"engine_cpus": format_cpu_list(available_cpus())}).validate()


@pytest.mark.skipif(len(available_cpus()) < 2, reason="needs two CPUs to tell pinned from unpinned")
def test_pin_process_pins_threads_already_running_and_threads_started_later() -> None:
    """In a child process (pinning is process-wide): a thread started before and one after the call
    both end up on the one CPU asked for, and the call reports that CPU alone."""
    target, all_cpus = available_cpus()[-1], available_cpus()
    script = textwrap.dedent(f"""
        import json, os, threading
        from lorarl.common.cpu_affinity import pin_process
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        assert len(os.sched_getaffinity(before.native_id)) > 1
        reported = pin_process([{target}])
        after = threading.Thread(target=stop.wait); after.start()
        sets = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
        widened = pin_process({all_cpus})  # a pinned process may be given every CPU back
        stop.set()
        print(json.dumps({{"reported": reported, "sets": sets, "widened": widened}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["reported"] == [target]
    assert len(got["sets"]) >= 3 and all(s == [target] for s in got["sets"])
    assert got["widened"] == all_cpus
