"""One glibc malloc arena for a process whose threads take turns on big allocations (a trainer with several jobs).

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

logger = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas(count: int = 1) -> bool:
    """Caps glibc's arenas at ``count`` for threads that allocate from now on; True when glibc took it."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_ARENA_MAX, count))
    if not ok:
        logger.debug("mallopt(M_ARENA_MAX, %d) refused", count)
    return ok
