"""Worker processes forked from a test process rather than spawned: a spawned one imports torch (and
megatron-core, vLLM) again, ~8-14 s of CPU each on the 2-core machine, which the suite paid dozens of times (#29).

A fork is safe here for the reasons lorarl/rollout/vllm/core_process.py gives for the rollout service: the test
processes run one OpenMP thread (no pool to break in the child), their other threads wait while a test forks,
and the parent's garbage is collected and the rest frozen first, so the child's collections never free an object
of the parent's (a gRPC object freed in a forked child spins forever joining a poller thread that is not there).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Around the start of forked children: the parent's objects out of the children's collections."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
