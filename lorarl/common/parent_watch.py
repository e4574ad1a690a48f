"""Children that exit when the process that started them dies.

A SIGKILLed service cannot stop what it started, and vLLM's engine core outlived its rollout by
minutes (1.7 GB held). The service marks its environment before starting children (``mark``); a
child that finds the mark (vLLM loads lorarl's plugin in each of its processes, which calls
``watch_if_marked``) polls its parent and exits once it has been re-parented. Polling rather than
PR_SET_PDEATHSIG: that fires when the *thread* that forked exits, which a worker thread does.
"""

from __future__ import annotations

import os
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


def watch_if_marked(poll_s: float = POLL_S) -> bool:
    """In a marked child (idempotent): a daemon thread exits the process once its parent is gone."""
    global _watching
    if os.environ.get(ENV) != "1" or _watching == os.getpid() or os.getppid() == 1:
        return False
    if os.environ.get(f"{ENV}_PID") == str(os.getpid()):
        return False  # the service itself
    _watching = os.getpid()
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="lorarl-parent-watch", daemon=True).start()
    return True
