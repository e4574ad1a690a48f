"""glibc malloc settings at run time: one arena for a process whose threads take turns on big allocations (a
trainer with several jobs), and freed heap handed back to the system (a long-lived engine process).

glibc gives each thread that allocates its own arena and keeps what a thread frees in that thread's
arena, so a trainer whose jobs run on several engine threads holds one activation-sized high-water mark
per thread: at the Qwen3-0.6B shape, 4 jobs on one base peaked at 4.3 GiB with the default arenas and
3.1 GiB with one (bench/multitenant.py, the same tokens/s). ``mallopt(M_ARENA_MAX)`` is the runtime form
of $MALLOC_ARENA_MAX; hand-written through ctypes because no library wraps it, and a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
M_ARENA_MAX = -8


def _libc(symbol: str) -> Any:
    """glibc's ``symbol``, or None off glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return getattr(ctypes.CDLL(name), symbol)
    except (OSError, AttributeError):
        return None


def _mallopt(param: int, value: int) -> bool:
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(param, value))
    if not ok:
        logger.debug("mallopt(%d, %d) refused", param, value)
    return ok


def limit_malloc_arenas(count: int = 1) -> bool:
    """Caps glibc's arenas at ``count`` for threads that allocate from now on; True when glibc took it."""
    return _mallopt(M_ARENA_MAX, count)


def fix_mmap_threshold(nbytes: int) -> bool:
    """Allocations of ``nbytes`` and more get pages of their own, handed back when freed (the runtime form of
    $MALLOC_MMAP_THRESHOLD_); True when glibc took it. glibc's default threshold grows up to 32 MiB as big blocks
    are freed, so a CPU trainer's step-sized tensors below that stay in the heap, and its peak carried the last
    step's freed heap: at the Qwen3-0.6B shape 5.10 GiB against 4.41 with an 8 MiB threshold, for steps ~7% faster
    (bench/service_memory.py, side by side; a 1 MiB threshold cost ~10%)."""
    return _mallopt(M_MMAP_THRESHOLD, nbytes)


def trim_malloc() -> bool:
    """Hands the free memory of every glibc arena back to the system (``malloc_trim(0)``); True when some was.
    A vLLM engine core that loads an adapter every step keeps the heap its freed blocks leave between live ones:
    bench/soak.py saw its resident set creep ~0.3 MiB a step for hundreds of steps. Trimming after each load
    keeps it flat at a cost of milliseconds, where a fixed $MALLOC_MMAP_THRESHOLD_ made every step 13% slower."""
    malloc_trim = _libc("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))
