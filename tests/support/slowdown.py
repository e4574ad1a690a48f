"""Makes chosen test files slower, to show the time budget catching code that slows down (issue "the first hour":
"fails when a file recorded above 10 s is made 3x slower").

    pytest -p tests.support.slowdown --slowdown tests/unit/test_x.py=3 --budget tests/budget.json tests/unit/test_x.py

Each test of the named file sleeps (FACTOR - 1) times its own call's duration after it runs, so the file takes
about FACTOR times as long, as code that got FACTOR times slower would; nothing else changes (the calibration
that sets the run's pace does not see it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slowdown", action="append", default=[], metavar="FILE=FACTOR",
                     help="make the tests of FILE FACTOR times slower")


def _factors(config: pytest.Config) -> dict[str, float]:
    factors = {}
    for spec in config.getoption("--slowdown"):
        path, _, factor = spec.rpartition("=")
        if not path or float(factor) < 1:
            raise pytest.UsageError(f"--slowdown takes FILE=FACTOR with FACTOR >= 1, got {spec!r}")
        factors[path] = float(factor)
    return factors


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    factor = _factors(item.config).get(item.nodeid.split("::", 1)[0], 1.0)
    start = time.perf_counter()
    yield
    if factor > 1:
        time.sleep((factor - 1) * (time.perf_counter() - start))
