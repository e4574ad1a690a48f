"""glibc settings the services apply at run time (lorarl.common.malloc_arenas), checked by what the process's
resident set does in a fresh interpreter: with the trainer's fixed mmap threshold a freed 16 MiB block goes back
to the system; with glibc's sliding default the second one stays in the heap."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lorarl.trainer.service.config import TrainerSettings
from lorarl.trainer.service.server import apply_allocator

PROBE = """
import ctypes, sys
from lorarl.common.malloc_arenas import fix_mmap_threshold
if sys.argv[1] != "0":
    assert fix_mmap_threshold(int(sys.argv[1]) << 20)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024
size = 16 << 20
for _ in range(2):  # glibc's default raises its threshold past the first freed block: the second is heap
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    before = rss()
    libc.free(p)
print(before - rss())
"""


def freed_mib(threshold_mib: int) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, str(threshold_mib)], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_a_fixed_threshold_hands_freed_blocks_back_and_the_default_keeps_them() -> None:
    assert freed_mib(8) >= 15  # the block's pages went back when it was freed
    assert freed_mib(0) <= 1  # glibc's sliding threshold: the second block stayed in the heap


def test_the_trainer_applies_its_threshold_unless_the_operator_set_one(monkeypatch) -> None:
    import lorarl.common.malloc_arenas as arenas

    applied: list[int] = []
    monkeypatch.setattr(arenas, "fix_mmap_threshold", lambda n: applied.append(n) or True)  # not in this worker
    assert TrainerSettings().malloc_mmap_threshold_mib == 8
    assert apply_allocator(8, {}) is True and applied == [8 << 20]
    assert apply_allocator(0, {}) is False  # glibc's own
    assert apply_allocator(8, {"MALLOC_MMAP_THRESHOLD_": "1048576"}) is False  # the environment wins
