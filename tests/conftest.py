"""Suite-wide: the per-file time budget (`make test` passes `--budget tests/budget.json`) and how the tests
share the two workers `make test` runs them on (pytest-xdist, `--dist loadgroup`).

By default a file's tests stay together on one worker, so a module-scoped engine or stack starts once.
The files below are the exceptions: tests that share nothing but the machine spread across both workers,
and files that listen on fixed loopback ports never run at the same time as each other.
"""

from __future__ import annotations

import os

import pytest

# One OpenMP thread per test process (set before anything imports torch; a caller's value wins): with
# two workers on two cores, an in-process vLLM engine's two spinning OpenMP threads made
# tests/integration/rollout/test_vllm_dense.py take 247 s beside one busy core instead of 41 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# vLLM engines the tests start in their own process fork their engine core as the rollout service does
# (lorarl/rollout/vllm/core_process.py: ~14 s of imports saved per engine core and tensor-parallel worker): one
# OpenMP thread (no pool to break in the child), and the other threads of a test process wait while it forks.
from lorarl.rollout.vllm.core_process import declare_fork_safe

declare_fork_safe()

pytest_plugins = ["tests.support.budget"]

#: Each test starts and stops everything it uses: scheduled one by one.
INDEPENDENT = frozenset({
    "tests/e2e/test_rl_loop.py",
    "tests/e2e/test_sdk.py",
    "tests/e2e/test_own_job.py",
    "tests/e2e/test_faults.py",
    "tests/e2e/test_launcher_exit.py",
    "tests/unit/test_bench_scripts.py",
})
#: Servers on fixed loopback ports (README's recipe, the Slurm stand-ins): one worker, one after another.
FIXED_PORTS = frozenset({
    "tests/e2e/test_readme_recipe.py",
    "tests/integration/deploy/test_slurm.py",
})


def xdist_group(path: str) -> str | None:
    """The scheduling group of a test file's tests; None: each test on its own."""
    if path in INDEPENDENT:
        return None
    return "fixed-ports" if path in FIXED_PORTS else path


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = xdist_group(path)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
        if path.startswith("tests/e2e/"):
            item.add_marker(pytest.mark.e2e)
