"""Children that exit when the process that started them dies.

A SIGKILLed service cannot stop what it started, and vLLM's engine core outlived its rollout by
minutes (1.7 GB held); a SIGKILLed launcher (`lorarl run`, `lorarl tinker`: the OOM killer, a lost SSH
session) left its three services running. A starter marks its children's environment (``mark`` for
everything a service starts, ``child_env`` for the services a launcher starts); a child that finds the mark
(`lorarl serve` on start-up; vLLM loads lorarl's plugin in each of its processes, which calls
``watch_if_marked``) polls its parent and leaves once it has been re-parented: a service stops as on SIGTERM
(its own children, files and ports released) within ``grace_s``, an engine process exits at once. Polling
rather than PR_SET_PDEATHSIG: that fires when the *thread* that forked exits, which a worker thread does.
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "LORARL_WATCH_PARENT"
POLL_S = 1.0
_watching: int | None = None  # the process whose watch runs: a forked child inherits the value, not the thread
_fork_hook = False


def mark() -> None:
    """Called by a service before it starts child processes: they will watch their parent. A forked child
    (vLLM's engine core on CPU: lorarl/rollout/vllm/core_process.py) starts its watch at the fork, since vLLM
    loads its plugins once per interpreter and a fork is not a new one."""
    global _fork_hook
    os.environ[ENV] = "1"
    os.environ[f"{ENV}_PID"] = str(os.getpid())
    if not _fork_hook:
        os.register_at_fork(after_in_child=watch_if_marked)
        _fork_hook = True


def child_env(pid: int | None = None) -> dict[str, str]:
    """The environment entries that make a process started now watch ``pid`` (default: this process), without
    marking this process's own environment: what a launcher adds to each service it starts."""
    return {ENV: "1", f"{ENV}_PID": str(pid if pid is not None else os.getpid())}


def watch_if_marked(poll_s: float = POLL_S, grace_s: float | None = None) -> bool:
    """In a marked child (idempotent): a daemon thread ends the process once its parent is gone. With
    ``grace_s`` it first SIGTERMs itself (a service stops as it does on a supervisor's stop) and exits only if
    that has not ended it within ``grace_s``; without, it exits at once."""
    global _watching
    if os.environ.get(ENV) != "1" or _watching == os.getpid() or os.getppid() == 1:
        return False
    if os.environ.get(f"{ENV}_PID") == str(os.getpid()):
        return False  # the service itself
    _watching = os.getpid()
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        if grace_s is not None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="lorarl-parent-watch", daemon=True).start()
    return True
