"""The weight-sync service, replica processes and polling helpers, for the integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from lorarl.common.config import load_config
from lorarl.common.server import RunningServer
from lorarl.weightsync.service.config import WeightSyncServiceConfig
from lorarl.weightsync.service.core import WeightSyncCore
from lorarl.weightsync.service.server import start_weightsync

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "weightsync-test-token"




def service_overrides(storage: Path, port: int = 0, host: str = "127.0.0.1", **settings: Any) -> list[str]:
    overrides = [f"weightsync.storage_dir={storage}", f"server.port={port}", f"server.host={host}",
                 "server.metrics_port=-1", "server.shutdown_grace_s=0.5", f"server.auth.token={TOKEN}"]
    return overrides + [f"weightsync.{k}={v}" for k, v in settings.items()]


@contextlib.asynccontextmanager
async def running_service(storage: Path, port: int = 0, **settings: Any
                          ) -> AsyncIterator[tuple[RunningServer, WeightSyncCore]]:
    """The real WeightSyncService in this event loop."""
    config = load_config(WeightSyncServiceConfig, overrides=service_overrides(storage, port, **settings), env={})
    running, servicer = await start_weightsync(config)
    try:
        yield running, servicer.core
    finally:
        await running.stop(0)


async def eventually(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Polls `predicate` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)


class ReplicaProcess:
    """tests/integration/weightsync/agent_main.py as a child process, and what it recorded."""

    def __init__(self, target: str, replica_id: str, workdir: Path, *args: str,
                 prefix: Sequence[str] = ()) -> None:
        self.replica_id = replica_id
        self.events_path = workdir / f"{replica_id}.{time.monotonic_ns()}.events.jsonl"
        self.log_path = self.events_path.with_suffix(".log")
        self.command = [*prefix, sys.executable, "-m", "tests.integration.weightsync.agent_main", "--target", target,
                        "--replica-id", replica_id, "--events", str(self.events_path), *args]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ReplicaProcess:
        env = {**os.environ, "LORARL_AUTH_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def events(self, kind: str | None = None, **match: Any) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        entries = [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]
        return [e for e in entries if (kind is None or e["event"] == kind)
                and all(e.get(k) == v for k, v in match.items())]

    async def wait_for(self, kind: str, timeout: float = 60, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"{self.replica_id} exited ({self.process.returncode}):\n{self.log()}")
            hits = self.events(kind, **match)
            return hits[-1] if hits else None

        return await eventually(found, timeout, f"{self.replica_id}: {kind} {match}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)


@contextlib.contextmanager
def replica_processes() -> Any:
    """Collects ReplicaProcesses and kills whatever is still running at the end."""
    started: list[ReplicaProcess] = []

    def launch(*args: Any, **kwargs: Any) -> ReplicaProcess:
        replica = ReplicaProcess(*args, **kwargs).start()
        started.append(replica)
        return replica

    try:
        yield launch
    finally:
        for replica in started:
            replica.kill()
