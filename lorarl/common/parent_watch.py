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
_started = threading.Event()


def mark() -> None:
    """Called by a service before it starts child processes: they will watch their parent."""
    os.environ[ENV] = "1"
    os.environ[f"{ENV}_PID"] = str(os.getpid())


def watch_if_marked(poll_s: float = POLL_S) -> bool:
    """In a marked child (idempotent): a daemon thread exits the process once its parent is gone."""
    if os.environ.get(ENV) != "1" or _started.is_set() or os.getppid() == 1:
        return False
    if os.environ.get(f"{ENV}_PID") == str(os.getpid()):
        return False  # the service itself
    _started.set()
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="lorarl-parent-watch", daemon=True).start()
    return True
