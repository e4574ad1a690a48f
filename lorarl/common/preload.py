"""Work a process will need soon, done in a daemon thread while it waits on something else.

Most of a service's start is imports (transformers' auto classes alone: ~5 s of CPU on the 2-core machine). A
process that knows what it will need after an idle wait imports it during the wait instead of on the critical
path: the trainer service its engine module before the first CreateJob, `lorarl run` the job's tokenizer while
its services start. Python's import lock makes a caller that arrives first simply wait for the thread's import.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def in_background(work: Callable[..., Any], *args: Any, name: str = "lorarl-preload") -> threading.Thread:
    """Runs ``work(*args)`` in a daemon thread; a failure is only logged, since the real call meets it again and
    reports it where it belongs."""

    def run() -> None:
        try:
            work(*args)
        except Exception as e:  # a preload must never be the one to fail a process
            logger.debug("preload %s failed: %s", getattr(work, "__name__", work), e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def import_in_background(*modules: str) -> threading.Thread:
    """Imports ``modules`` in a daemon thread."""
    return in_background(lambda: [importlib.import_module(m) for m in modules], name="lorarl-preload-imports")
