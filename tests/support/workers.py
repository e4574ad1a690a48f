"""Runs test worker processes forked from a fork server, with a deadline, so a stuck collective fails the test.

The suite's multi-process tests (gloo worlds of 2-3 ranks) once spawned each worker, which imported torch,
megatron-core and lorarl again (~8 CPU-s per worker, two or three per call, ~20 calls: about 4 of the suite's
minutes, #29). multiprocessing's `forkserver` imports them once per test process, in a server of its own, and
forks each worker from it. Not forked from the test process itself: that process may hold an initialized
torch.distributed world (a one-process engine), which a forked worker would inherit.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp

from lorarl.common.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
#: What the fork server imports before its first fork: what the workers of the multi-rank tests need.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "lorarl.trainer.engines.megatron.engine",
           "lorarl.trainer.engines.torch.engine", "lorarl.weightsync.wire.collective", "tests.support.workers",
           "tests.support.megatron_workers"]
#: A free port is chosen, closed, then bound by rank 0 moments later: another process of the suite (the other
#: xdist worker's services) can take it in between. Such a start is tried again.
PORT_ATTEMPTS = 3


def start_fork_server() -> None:
    """Starts this process's fork server with PRELOAD imported (once; later calls return at once). Python 3.11's
    fork server ignores the sys.path it is sent, so the repository goes on its PYTHONPATH for the start."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), before) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def worker_context() -> multiprocessing.context.BaseContext:
    """A multiprocessing context whose processes fork from the preloaded fork server."""
    start_fork_server()
    return mp.get_context("forkserver")


def run_workers(fn: Callable[..., None], nprocs: int, args: tuple, timeout_s: float = 120.0) -> None:
    """Calls fn(rank, nprocs, init_method, *args) in nprocs worker processes; raises on error or timeout."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_once(fn, nprocs, args, timeout_s)
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == PORT_ATTEMPTS - 1:
                raise


def _run_once(fn: Callable[..., None], nprocs: int, args: tuple, timeout_s: float) -> None:
    start_fork_server()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.start_processes(fn, args=(nprocs, init_method, *args), nprocs=nprocs, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):  # raises ProcessRaisedException when a worker fails
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{nprocs} workers running {fn.__name__} did not finish within {timeout_s:.0f} s")
