"""OpenMP thread binding for a vLLM CPU engine with several workers (tensor or pipeline parallel).

vLLM's CPU backend binds each worker's OpenMP threads by NUMA node unless VLLM_CPU_OMP_THREADS_BIND
says otherwise, and refuses to start with more workers than allowed NUMA nodes ("Not enough allowed
NUMA nodes to bind threads of 2 local CPUWorkers"), which a laptop or a CI runner always has. The
rollout sets the binding from the CPUs it may use (rollout.engine_cpus, else this process's affinity):
contiguous, equal groups, one per worker, so the workers never share a CPU. A value the user set wins.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping, Sequence

from lorarl.common.cpu_affinity import format_cpu_list

logger = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def worker_cpu_groups(cpus: Sequence[int], workers: int) -> list[list[int]]:
    """``cpus`` split into ``workers`` contiguous groups of equal size (a remainder stays unused)."""
    ordered = sorted(set(cpus))
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if len(ordered) < workers:
        raise ValueError(f"{workers} vLLM CPU workers need a CPU each, but only {len(ordered)} "
                         f"({format_cpu_list(ordered) or 'none'}) are available: lower rollout.tensor_parallel_size "
                         f"or give the rollout more CPUs (rollout.engine_cpus, or {BIND_ENV})")
    size = len(ordered) // workers
    return [ordered[i * size:(i + 1) * size] for i in range(workers)]


def thread_binding(cpus: Sequence[int], workers: int) -> str:
    """The VLLM_CPU_OMP_THREADS_BIND value for these CPUs: ``"0|1"``, ``"0-3|4-7"``."""
    return "|".join(format_cpu_list(group) for group in worker_cpu_groups(cpus, workers))


def apply_thread_binding(cpus: Sequence[int], workers: int, environ: MutableMapping[str, str] = os.environ
                         ) -> str | None:
    """Sets the binding for a multi-worker CPU engine before it starts; returns what is in force (None
    with one worker, where vLLM's own default is right)."""
    if workers <= 1:
        return None
    if environ.get(BIND_ENV):
        logger.info("vLLM CPU workers bound by %s=%s (set by the caller)", BIND_ENV, environ[BIND_ENV])
        return environ[BIND_ENV]
    environ[BIND_ENV] = thread_binding(cpus, workers)
    logger.info("vLLM CPU workers bound to CPUs %s (%s)", environ[BIND_ENV], BIND_ENV)
    return environ[BIND_ENV]
