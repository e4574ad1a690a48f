"""A marked child exits once the process that started it is SIGKILLed (vLLM's engine core, through the plugin)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

CHILD = """
from lorarl.common.parent_watch import watch_if_marked
import time
assert watch_if_marked(poll_s=0.1)
time.sleep(120)
"""
PARENT = """
import subprocess, sys, time
from lorarl.common.parent_watch import mark
mark()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_marked_child_exits_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))  # type: ignore[union-attr]
        time.sleep(1.0)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE  # alive while its parent lives
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert gone and not alive, "the child outlived its parent"
    finally:
        parent.kill()
FORKING_PARENT = """
import os, time
from lorarl.common.parent_watch import mark
mark()
if os.fork() == 0:  # the engine core, forked (lorarl/rollout/vllm/core_process.py)
    worker = os.fork()  # a tensor-parallel worker it forks in turn
    if worker == 0:
        time.sleep(120)
        os._exit(0)
    print(os.getpid(), worker, flush=True)
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


def test_forked_children_and_their_own_forks_exit_when_the_service_is_killed() -> None:
    """vLLM loads lorarl's plugin once per interpreter; a fork is not a new one, so the watch starts at the fork."""
    parent = subprocess.Popen([sys.executable, "-c", FORKING_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        forked = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(forked) == 2
        time.sleep(1.5)
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in forked)
        assert all(any(t.id != p.pid for t in p.threads()) for p in forked)  # each runs its watch thread
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        gone, alive = psutil.wait_procs(forked, timeout=15)
        assert len(gone) == 2 and not alive, "a forked child outlived the service"
    finally:
        parent.kill()


def test_an_unmarked_process_and_the_service_itself_do_not_watch(monkeypatch) -> None:
    from lorarl.common import parent_watch

    monkeypatch.delenv(parent_watch.ENV, raising=False)
    assert not parent_watch.watch_if_marked()
    monkeypatch.setenv(parent_watch.ENV, "1")
    monkeypatch.setenv(f"{parent_watch.ENV}_PID", str(os.getpid()))
    assert not parent_watch.watch_if_marked()  # the process that marked its environment
