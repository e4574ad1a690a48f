"""`lorarl run`'s supervisor: a service that exits is restarted at most recovery.restarts times in a row, and
one that then stays up HEALTHY_UPTIME_S starts that count again (a run that meets a restart now and then, for
days, keeps its services; a crash loop still ends it)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from lorarl.client.launch import local
from lorarl.client.launch.local import LocalStack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_service_that_stays_up_starts_its_restart_count_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(local, "HEALTHY_UPTIME_S", 3.0)
    monkeypatch.setattr(local, "RESTART_PAUSE_MIN_S", 0.1)
    stack = LocalStack(tmp_path, {"weightsync": {"storage_dir": str(tmp_path / "store")}}, services=("weightsync",))
    with stack:
        stack.supervise(restarts=1)
        for kill in range(2):  # two kills: with one restart allowed in a row, the second needs the reset
            first = stack.processes["weightsync"]
            os.kill(first.process.pid, signal.SIGKILL)
            wait_until(lambda first=first: stack.processes["weightsync"] is not first or stack.failure is not None,
                       120, f"restart {kill + 1}")
            assert stack.failure is None, stack.failure
            assert stack.processes["weightsync"].restarts == 1
            wait_until(lambda: stack.processes["weightsync"].restarts == 0, 30, "the count starting again")
        # without the uptime, a second exit in a row ends the run
        monkeypatch.setattr(local, "HEALTHY_UPTIME_S", 3600.0)
        first = stack.processes["weightsync"]
        os.kill(first.process.pid, signal.SIGKILL)
        wait_until(lambda: stack.processes["weightsync"] is not first, 120, "restart 3")
        os.kill(stack.processes["weightsync"].process.pid, signal.SIGKILL)
        wait_until(lambda: stack.failure is not None, 60, "the run failing")
        assert "restarted 1 times" in str(stack.failure)


def test_dead_services_come_back_side_by_side(tmp_path: Path, monkeypatch) -> None:
    """Two services die, the first one's start needing the second up (as the rollout cannot get ready until it
    subscribes to weight sync): each restarts in its own thread, so the first waits for the second's restart
    and both are back, each restarted once. One restart queue would hold weight sync behind the trainer's
    start until that start gave up (a test_faults run lost 190 s so)."""
    import threading

    monkeypatch.setattr(local, "RESTART_PAUSE_MIN_S", 0.1)
    stack = LocalStack(tmp_path, {"weightsync": {"storage_dir": str(tmp_path / "store")}},
                       services=("weightsync", "trainer"))
    with stack:
        launch = stack._launch
        weightsync_back, trainer_starting = threading.Event(), threading.Event()

        def launch_after_weightsync(name: str, *args, **kwargs):
            if name == "trainer":
                trainer_starting.set()
                if not weightsync_back.wait(30):
                    raise RuntimeError("trainer service did not start: weight sync never came back")
            started = launch(name, *args, **kwargs)
            if name == "weightsync":
                weightsync_back.set()
            return started

        monkeypatch.setattr(stack, "_launch", launch_after_weightsync)
        stack.supervise(restarts=1)
        first = dict(stack.processes)
        os.kill(first["trainer"].process.pid, signal.SIGKILL)
        wait_until(trainer_starting.is_set, 30, "the trainer's restart starting")
        os.kill(first["weightsync"].process.pid, signal.SIGKILL)
        wait_until(lambda: all(stack.processes[n] is not first[n] for n in first) or stack.failure is not None,
                   120, "both services back")
        assert stack.failure is None, stack.failure
        assert {n: stack.processes[n].restarts for n in first} == {"weightsync": 1, "trainer": 1}
        assert sorted(name for name, _, _ in stack.restart_log) == ["trainer", "weightsync"]


def test_a_service_log_is_kept_under_its_cap_while_the_service_writes(tmp_path: Path) -> None:
    """A real weight sync service logs each call it rejects; with a 2 KiB cap and one copy, its log is rotated
    while the process keeps appending to it: the live file starts again at zero (no hole where the old
    content was), the newest line is kept, one copy and no more."""
    import grpc

    from lorarl.client.launch.log_files import LogRetention, backup_path
    from lorarl.v1 import weightsync_pb2, weightsync_pb2_grpc

    retention = LogRetention(max_bytes=2 << 10, backups=1)
    stack = LocalStack(tmp_path, {"weightsync": {"storage_dir": str(tmp_path / "store")}}, services=("weightsync",),
                       log_retention=retention)
    stack.log_rotator.interval_s = 0.05
    with stack:
        log = stack.processes["weightsync"].log_path
        with grpc.insecure_channel(stack.address("weightsync")) as channel:
            stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
            for call in range(60):  # no token: each is refused and logged ("rejected unauthenticated call")
                with pytest.raises(grpc.RpcError) as refused:
                    stub.GetSyncStatus(weightsync_pb2.GetSyncStatusRequest(job_id=f"call-{call}"), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                time.sleep(0.02)
        wait_until(lambda: stack.log_rotator.rotations >= 3, 30, "three rotations")
        rotations = stack.log_rotator.rotations
        wait_until(lambda: "rejected unauthenticated call" in log.read_text(), 30, "a line after the rotation")
        assert stack.processes["weightsync"].process.poll() is None
    kept = [log, backup_path(log, 1)]
    for path in kept:
        data = path.read_bytes()
        assert b"\0" not in data and len(data) <= retention.max_bytes + 4096, (path.name, len(data))
    assert not backup_path(log, 2).exists()
    assert rotations >= 3 and stack.log_rotator.generations[log] == stack.log_rotator.rotations
