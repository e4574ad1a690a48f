"""A time budget per test file, enforced at the end of `make test` (`--budget tests/budget.json`).

The suite has to fit CI's limit as it grows, so each file's wall time (setup + call + teardown of all its
tests) is held to what was recorded for it, with headroom for a noisy machine, scaled by the run's pace; a file
that is not in the record gets the default, and the whole run's wall time at pace 1.0 is capped (``total_s``,
with TOTAL_MARGIN for the calibration's error).

The pace is how much slower this run's machine is than the record's, between 1 and MAX_PACE: its speed (a
fixed calibration workload's CPU seconds, sampled every 15 s while the suite runs, median, over the record's
``calibration_s``) times its load (how much CPU other work beside the suite took: cores / (cores - foreign));
see tests/support/pace.py for both readings and why. So a slower or busier machine moves every budget alike,
while code that gets slower (one file, or all of it) moves neither reading and goes over. (Until stop 52 the
pace was the recorded files' own seconds against their record: a uniform slowdown of the code read as a slow
machine; until stop 54 it was the calibration's wall seconds, which a busy loop beside the suite moved 1.15x
while the suite ran 1.54x slower, and a correct suite failed.) A record without ``calibration_s`` falls back to
the files' pace. A run nested in another suite (the budget's own tests) passes ``--budget-ignore-load``: its
neighbours are its parent suite, already there when its record was taken.
A file past its budget fails the session and is named, with its measured and
allowed seconds, so a new slow test is seen when it lands. Session-scoped fixtures (a shared engine, a
shared demo run) are budgeted under their own name (``fixture:NAME``), not under whichever file happened
to need them first, so the figures do not move with test order or selection.

`--budget-record PATH` writes the measured seconds of a run as the new record (keeps the headroom
settings); ``python -m tests.support.budget OUT RECORD...`` writes several runs' records as one, each file at
its slowest (what tests/budget.json holds: one run's record fails the next run where a file's time varies).
Hand-written as a small plugin: pytest's own `--durations` reports but does not enforce.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.pace import MachineLoad, PaceClock

DEFAULTS = {"headroom": 1.5, "slack_s": 15.0, "default_s": 20.0, "unmarked_s": 10.0, "total_s": 1800.0,
            "calibration_s": 0.0}
#: A machine past twice the record's pace is not let off: its run fails where a file goes over at 2x.
MAX_PACE = 2.0
#: The whole-run cap's allowance for the pace's error (the load factor is an average over the run; a file's
#: neighbours come and go). The per-file budgets have their own headroom.
TOTAL_MARGIN = 1.1


@dataclass(frozen=True)
class Budget:
    """The recorded seconds per file (or ``fixture:NAME``) and how far past them a run may go."""

    files: Mapping[str, float]
    headroom: float = DEFAULTS["headroom"]
    slack_s: float = DEFAULTS["slack_s"]
    default_s: float = DEFAULTS["default_s"]
    unmarked_s: float = DEFAULTS["unmarked_s"]  # a test not marked slow may take this long
    total_s: float = DEFAULTS["total_s"]  # the whole run's wall seconds at pace 1.0
    calibration_s: float = DEFAULTS["calibration_s"]  # calibrate()'s median while the record was taken (0: none)

    @classmethod
    def load(cls, path: Path) -> Budget:
        data = json.loads(path.read_text())
        unknown = set(data) - {"files", *DEFAULTS}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}; expected files, {', '.join(DEFAULTS)}")
        return cls(files={str(k): float(v) for k, v in data.get("files", {}).items()},
                   **{k: float(data[k]) for k in DEFAULTS if k in data})

    def allowed(self, name: str, pace: float = 1.0) -> float:
        """Seconds `name` may take: its record with headroom at this run's ``pace``, or the default for a name not
        recorded."""
        if name not in self.files:
            return self.default_s
        return self.files[name] * self.headroom * pace + self.slack_s

    def pace(self, measured: Mapping[str, float], calibration_s: float | None = None, load: float = 1.0) -> float:
        """How much slower this run's machine went than the record's, between 1 and MAX_PACE: the calibration
        workload's median CPU seconds this run over the record's (a slower CPU), times ``load`` (other work beside
        the suite, `MachineLoad.factor`), where a calibration exists on both sides. Else the old way: the seconds
        of the files both name over their recorded seconds (which reads code that slows alike as a slow
        machine)."""
        if calibration_s and self.calibration_s:
            return min(MAX_PACE, max(1.0, calibration_s / self.calibration_s * load))
        common = [n for n in measured if self.files.get(n, 0.0) > 0]
        recorded = sum(self.files[n] for n in common)
        if not recorded:
            return 1.0
        return min(MAX_PACE, max(1.0, sum(measured[n] for n in common) / recorded))

    def over(self, measured: Mapping[str, float], pace: float) -> list[tuple[str, float, float]]:
        """(name, measured, allowed) for each name past its budget at this ``pace``, slowest first."""
        found = [(n, s, self.allowed(n, pace)) for n, s in measured.items() if s > self.allowed(n, pace)]
        return sorted(found, key=lambda row: -row[1])

    def nearest(self, measured: Mapping[str, float], count: int, pace: float) -> list[tuple[str, float, float]]:
        """(name, measured, allowed) for the `count` names that used most of their budget, most first."""
        rows = [(n, s, self.allowed(n, pace)) for n, s in measured.items()]
        return sorted(rows, key=lambda row: -row[1] / row[2])[:count]

    def recorded(self, measured: Mapping[str, float], calibration_s: float | None = None) -> dict:
        """This run's figures as a new record, the settings kept (and this run's calibration, where sampled)."""
        return {"headroom": self.headroom, "slack_s": self.slack_s, "default_s": self.default_s,
                "unmarked_s": self.unmarked_s, "total_s": self.total_s,
                "calibration_s": round(calibration_s or self.calibration_s, 4),
                "files": {n: round(s, 1) for n, s in sorted(measured.items())}}

    @classmethod
    def slowest(cls, records: list[Budget]) -> Budget:
        """One record from several runs' records: each name at its slowest, over the names of the last run (a
        file some runs took twice as long as others, e.g. the README recipe's 45 and 93 s, is not held to its
        fast run), the last run's settings kept."""
        last = records[-1]
        files = {n: max(r.files.get(n, 0.0) for r in records) for n in last.files}
        # the files at their slowest, and the machine as slow as the slowest calibration seen with them: pace
        # 1.0 is the record's busiest run, so a run on a busier machine still gets a pace above 1
        calibrations = [r.calibration_s for r in records if r.calibration_s]
        return cls(files=files, headroom=last.headroom, slack_s=last.slack_s, default_s=last.default_s,
                   unmarked_s=last.unmarked_s, total_s=last.total_s,
                   calibration_s=max(calibrations) if calibrations else 0.0)


NEAREST_SHOWN = 12
FIXTURES_KEY = "lorarl_session_fixture_s"
GROUP_SUFFIX = re.compile(r"@[\w./-]+$")
SLOW_KEY = "lorarl_marked_slow"


@dataclass
class Timings:
    """Wall seconds per test file, with the session-scoped fixtures' set-up split out by name."""

    per_name: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    per_test: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    marked_slow: set[str] = field(default_factory=set)

    def report(self, report: pytest.TestReport) -> None:
        seconds = report.duration
        for key, value in report.user_properties:
            if key == FIXTURES_KEY:
                for name, fixture_s in value.items():
                    self.per_name[f"fixture:{name}"] += fixture_s
                    seconds -= fixture_s
            elif key == SLOW_KEY and value:
                self.marked_slow.add(report.nodeid)
        seconds = max(0.0, seconds)
        nodeid = GROUP_SUFFIX.sub("", report.nodeid)  # xdist's loadgroup appends "@group"
        self.per_name[nodeid.split("::", 1)[0]] += seconds
        self.per_test[nodeid] += seconds

    def unmarked_slow(self, limit_s: float) -> list[tuple[str, float]]:
        """Tests past `limit_s` (their own time, shared fixtures apart) that `-m "not slow"` would still run."""
        found = [(n, s) for n, s in self.per_test.items() if s > limit_s and n not in self.marked_slow]
        return sorted(found, key=lambda row: -row[1])


class FixtureClock:
    """In the process that runs the tests (an xdist worker or the only one): times each outermost
    session-scoped fixture's set-up and hands it to the test's set-up report."""

    def __init__(self) -> None:
        self.pending: dict[str, float] = {}
        self.depth = 0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[None]:
        if fixturedef.scope != "session":
            yield
            return
        self.depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.pending[fixturedef.argname] = self.pending.get(fixturedef.argname, 0.0) + (
                    time.perf_counter() - start)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        if call.when == "setup" and self.pending:
            report.user_properties.append((FIXTURES_KEY, dict(self.pending)))
            self.pending.clear()
        if call.when == "setup" and item.get_closest_marker("slow") is not None:
            report.user_properties.append((SLOW_KEY, True))


class BudgetPlugin:
    """In the controlling process: adds up the reports, samples the pace, writes a record, fails a run past its
    budget."""

    def __init__(self, budget_path: Path | None, record_path: Path | None, read_load: bool = True) -> None:
        self.budget_path = budget_path
        self.record_path = record_path
        self.timings = Timings()
        self.budget: Budget | None = None
        self.over: list[tuple[str, float, float]] = []
        self.unmarked: list[tuple[str, float]] = []
        self.pace = 1.0
        self.clock = PaceClock()
        self.load = MachineLoad() if read_load else None
        self.started = time.monotonic()
        self.wall_s = 0.0

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.started = time.monotonic()
        self.clock.start()
        if self.load is not None:
            self.load.start()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.timings.report(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.clock.stop()
        if self.load is not None:
            self.load.stop()
        self.wall_s = time.monotonic() - self.started
        measured = dict(self.timings.per_name)
        calibration = self.clock.median()
        if self.record_path is not None:
            base = Budget.load(self.record_path) if self.record_path.exists() else Budget(files={})
            self.record_path.write_text(json.dumps(base.recorded(measured, calibration), indent=1) + "\n")
        if self.budget_path is None:
            return
        self.budget = Budget.load(self.budget_path)
        self.pace = self.budget.pace(measured, calibration, self.load.factor() if self.load is not None else 1.0)
        self.over = self.budget.over(measured, self.pace)
        if self.wall_s > self.budget.total_s * self.pace * TOTAL_MARGIN:
            self.over.append(("the whole run (wall time)", self.wall_s,
                              self.budget.total_s * self.pace * TOTAL_MARGIN))
        # the unmarked rule moves with the machine's pace as the file budgets do (a busy machine took 14.7 s
        # for a test of 10 s elsewhere, and failed a green suite on it)
        self.unmarked = self.timings.unmarked_slow(self.budget.unmarked_s * self.pace)
        if (self.over or self.unmarked) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def load_text(self) -> str:
        if self.load is None:
            return "load not read (--budget-ignore-load)"
        foreign = self.load.foreign_cpus()
        if foreign is None:
            return f"load not read: {self.load.why_not or 'no reading'}"
        cpus = len(self.load.cpus)
        return f"other work beside the suite {foreign:.2f} of {cpus} CPUs: load x{self.load.factor():.2f}"

    @pytest.hookimpl(trylast=True)  # after --durations: the last lines of a CI log say what went over
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.budget is None:
            return
        total = sum(self.timings.per_name.values())
        calibration = self.clock.median()
        how = (f"calibration {calibration:.3f} CPU s against the record's {self.budget.calibration_s:.3f} s, "
               f"{len(self.clock.samples)} samples; {self.load_text()}" if calibration and self.budget.calibration_s
               else "from the recorded files' seconds: the record has no calibration")
        terminalreporter.write_sep("=", f"time budget ({self.budget_path}): {total / 60:.1f} min of tests, "
                                        f"{self.wall_s / 60:.1f} min of wall time (at most "
                                        f"{self.budget.total_s / 60:.0f} at pace 1.0, x{TOTAL_MARGIN}), at "
                                        f"{self.pace:.2f}x the "
                                        f"record's pace ({how})")
        for name, seconds, allowed in self.budget.nearest(self.timings.per_name, NEAREST_SHOWN, self.pace):
            terminalreporter.write_line(f"{seconds / allowed:4.0%} of budget  {name}: {seconds:.1f} s of "
                                        f"{allowed:.1f} s")
        for name, seconds, allowed in self.over:
            terminalreporter.write_line(f"OVER BUDGET {name}: {seconds:.1f} s, allowed {allowed:.1f} s "
                                        "(share an engine or a run, or re-record with --budget-record)")
        limit = self.budget.unmarked_s * self.pace
        for name, seconds in self.unmarked:
            terminalreporter.write_line(f"NOT MARKED SLOW {name}: {seconds:.1f} s, past {limit:.1f} s at this pace "
                                        "(mark it pytest.mark.slow)")
        if not self.over and not self.unmarked:
            terminalreporter.write_line(f"every test file within its budget; every test past {limit:.1f} s "
                                        "marked slow")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("budget", "per-file time budget")
    group.addoption("--budget", type=Path, default=None, help="fail the run when a test file exceeds its budget")
    group.addoption("--budget-record", type=Path, default=None, help="write this run's seconds per file here")
    group.addoption("--budget-ignore-load", action="store_true", default=False,
                    help="pace by the calibration alone, not by other work beside the run (a run nested in a suite)")


def pytest_configure(config: pytest.Config) -> None:
    budget, record = config.getoption("--budget"), config.getoption("--budget-record")
    if not (budget or record):
        return
    worker = hasattr(config, "workerinput")
    distributing = not worker and bool(config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses"))
    if not worker:
        config.pluginmanager.register(BudgetPlugin(budget, record, not config.getoption("--budget-ignore-load")),
                                      "lorarl-budget")
    if not distributing:  # where the tests run: an xdist worker or the only process
        config.pluginmanager.register(FixtureClock(), "lorarl-fixture-clock")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="several runs' --budget-record files as one budget, each file at "
                                                 "its slowest")
    parser.add_argument("out", type=Path)
    parser.add_argument("records", type=Path, nargs="+", help="oldest first; the last one's files and settings")
    args = parser.parse_args(argv)
    merged = Budget.slowest([Budget.load(path) for path in args.records])
    args.out.write_text(json.dumps(merged.recorded(merged.files), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
