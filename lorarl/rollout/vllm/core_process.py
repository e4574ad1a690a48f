"""How vLLM's engine core process starts on CPU: forked from the rollout service rather than spawned.

vLLM runs its engine core (and, at tensor parallel > 1, a worker per rank) in child processes. Its CPU
platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` each time it builds a config, so every such child is a
fresh interpreter that imports vLLM and torch again: ~14 s of CPU per process on the 2-core machine, on the
critical path of every rollout start and restart. Forked, the child inherits what the service already
imported: a 2-step `lorarl run examples/demo.yaml` had its services up in 17.9 s instead of 35.6 s, and a
TP-2 run (three children) in 21.0 s instead of 38.8 s, with the same numbers out (bench/RESULTS.md).
On CUDA vLLM itself forks unless CUDA is already initialised.

Fork is only safe in a process that has not yet run OpenMP-parallel work (libgomp's thread pool does not
survive a fork) and runs no other thread: the child has only the forking thread, and what the others held
(their locks, the objects on their stacks) is lost or freed there. A gRPC object freed in the child joins a
poller thread that does not exist and spins forever; that is how an engine started inside a test process
that had served gRPC before hung at its first garbage collection. The rollout service starts its engine
before anything else, on its only thread, so it declares itself safe (``declare_fork_safe``) and forks while
it has one thread; any other process (a test harness, a benchmark building an engine beside other work)
keeps vLLM's spawn. A caller that sets ``VLLM_WORKER_MULTIPROC_METHOD`` itself keeps its choice either way:
the operator's way back to spawn.
"""

from __future__ import annotations

import os
import threading
from collections.abc import MutableMapping

ENV = "VLLM_WORKER_MULTIPROC_METHOD"
METHODS = ("fork", "spawn")
_fork_safe = False


def declare_fork_safe() -> None:
    """Called by a process that will start its engine before running any other work (the rollout service)."""
    global _fork_safe
    _fork_safe = True


def start_method(device_type: str, environ: MutableMapping[str, str] = os.environ,
                 fork_safe: bool | None = None, threads: int | None = None) -> str | None:
    """The start method to set once vLLM has built its config (read before it does: vLLM's CPU platform
    overwrites the variable); None leaves vLLM's own choice. The caller's explicit value wins."""
    chosen = environ.get(ENV, "")
    if chosen:
        if chosen not in METHODS:
            raise ValueError(f"{ENV}={chosen!r}: vLLM takes one of {', '.join(METHODS)}")
        return chosen
    safe = _fork_safe if fork_safe is None else fork_safe
    alone = (threading.active_count() if threads is None else threads) == 1
    return "fork" if safe and alone and device_type == "cpu" else None
