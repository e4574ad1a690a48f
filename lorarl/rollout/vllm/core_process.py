"""How vLLM's engine core process starts on CPU: forked from the rollout service rather than spawned.

vLLM runs its engine core (and, at tensor parallel > 1, a worker per rank) in child processes. Its CPU
platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` each time it builds a config, so every such child is a
fresh interpreter that imports vLLM and torch again: ~14 s of CPU per process on the 2-core machine, on the
critical path of every rollout start and restart. Forked, the child inherits what the service already
imported: a 2-step `lorarl run examples/demo.yaml` had its services up in 17.9 s instead of 35.6 s, and a
TP-2 run (three children) in 21.0 s instead of 38.8 s, with the same numbers out (single runs by hand on the
2-core machine, 2026-12-05, at f8f3fa8's parent with and without the change; bench/service_start.py measures
the two side by side, not yet run into bench/RESULTS.md).
On CUDA vLLM itself forks unless CUDA is already initialised.

What a fork needs, and how each need is met:
- no OpenMP pool yet (libgomp's does not survive a fork): the process has run no parallel torch work. The
  rollout service starts its engine before anything else; the test processes run one OpenMP thread.
- no other thread holding what the child needs (a lock, an object): the child has only the forking thread.
  The service has no other thread then; a test process's other threads (xdist's, idle gRPC pollers) wait.
- no process group: a child would inherit the parent's torch.distributed group (a world of its size) and
  vLLM's own init would join it instead of making the engine's. A process with one spawns.
- nothing of the parent's freed in the child: a gRPC object collected there joins a poller thread that does
  not exist and spins forever (an engine started in a test process that had served gRPC hung so at its
  first collection). Garbage is collected before the fork and the rest frozen (`gc.freeze`, as Python's
  documentation advises before a fork), so the child's collections never reach the parent's objects.
A process declares itself fit (``declare_fork_safe``); any other keeps vLLM's spawn (a benchmark building an
engine beside other work). A caller that sets ``VLLM_WORKER_MULTIPROC_METHOD`` itself keeps its choice
either way: the operator's way back to spawn.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, MutableMapping

ENV = "VLLM_WORKER_MULTIPROC_METHOD"
METHODS = ("fork", "spawn")
_fork_safe = False


def declare_fork_safe() -> None:
    """Called by a process fit to fork (see the module docstring): the rollout service, the test processes."""
    global _fork_safe
    _fork_safe = True


def start_method(device_type: str, environ: MutableMapping[str, str] = os.environ,
                 fork_safe: bool | None = None, process_group: bool | None = None) -> str | None:
    """The start method to set once vLLM has built its config (read before it does: vLLM's CPU platform
    overwrites the variable); None leaves vLLM's own choice. The caller's explicit value wins."""
    chosen = environ.get(ENV, "")
    if chosen:
        if chosen not in METHODS:
            raise ValueError(f"{ENV}={chosen!r}: vLLM takes one of {', '.join(METHODS)}")
        return chosen
    safe = _fork_safe if fork_safe is None else fork_safe
    grouped = _has_process_group() if process_group is None else process_group
    return "fork" if safe and not grouped and device_type == "cpu" else None


def _has_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def starting_children(method: str | None, caller: str | None,
                      environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """Around the engine's construction (its children start inside): vLLM's start method set, and for a fork
    the parent's garbage collected and the rest frozen until the children are up. Afterwards the variable is
    the ``caller``'s again (vLLM's config set it too), so the next engine in this process decides afresh."""
    if method:
        environ[ENV] = method
    if method == "fork":
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if method == "fork":
            gc.unfreeze()
        if caller is None:
            environ.pop(ENV, None)
        else:
            environ[ENV] = caller
