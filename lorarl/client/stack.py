"""The three services on loopback, as their own processes, for `lorarl run`.

Each service is started exactly as a user (or the compose stack) would start it: `lorarl serve
<service> --config FILE`, here with free ports, a generated bearer token and a ready file that
reports the bound port. The stack stops every process it started, on success, failure or Ctrl-C:
SIGTERM first (services drain in-flight RPCs), SIGKILL after a bound.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorarl.common.ready import wait_for_ready_file

SERVICES = ("weightsync", "trainer", "rollout")


def lorarl_command() -> list[str]:
    script = Path(sys.executable).with_name("lorarl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]


@dataclass
class ServiceProcess:
    name: str  # the process: "trainer", or "rollout-1" when the job runs several rollout replicas
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path
    service: str = ""


@dataclass
class LocalStack:
    """Starts weightsync, trainer and rollout (in that order) and knows their addresses."""

    workdir: Path
    sections: dict[str, dict[str, Any]]
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    start_timeout_s: float = 180.0
    threads_per_service: int = 1
    stop_timeout_s: float = 20.0
    processes: dict[str, ServiceProcess] = field(default_factory=dict)
    services: tuple[str, ...] = SERVICES
    rollout_replicas: int = 1
    #: Extra environment per process name, e.g. {"rollout-1": {"CUDA_VISIBLE_DEVICES": "2,3"}}.
    process_env: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Extra `server:` settings per process name, e.g. {"trainer": {"cpus": "1"}}.
    server_sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def address(self, name: str) -> str:
        """A process's address; "rollout" names the first replica when there are several."""
        if name not in self.processes and name == "rollout" and "rollout-0" in self.processes:
            name = "rollout-0"
        return self.processes[name].address

    def addresses(self, service: str) -> list[str]:
        """Every process of ``service`` (all rollout replicas), in start order."""
        return [p.address for p in self.processes.values() if p.service == service]

    def env(self) -> dict[str, str]:
        env = {**os.environ, "LORARL_AUTH_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        # Three processes share the CPU: one OpenMP thread each. Two threads per process on a
        # 2-core machine made a training step 20x slower (threads spinning against each other).
        env.setdefault("OMP_NUM_THREADS", str(self.threads_per_service))
        return env

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in self.services:
            section = dict(self.sections.get(name, {}))
            if name == "trainer" and "weightsync" in self.processes:
                section.setdefault("weightsync_address", self.address("weightsync"))
            if name == "rollout" and "weightsync" in self.processes:
                section.setdefault("weightsync_address", self.address("weightsync"))
            if name == "rollout" and self.rollout_replicas > 1:
                for i in range(self.rollout_replicas):
                    replica = {**section, "replica_id": f"rollout-{i}"}
                    self.processes[f"rollout-{i}"] = self._launch(f"rollout-{i}", replica, service="rollout")
                continue
            self.processes[name] = self._launch(name, section)

    def _launch(self, name: str, section: dict[str, Any], service: str = "") -> ServiceProcess:
        service = service or name
        config = {
            "server": {"host": "127.0.0.1", "port": 0, "metrics_port": -1, "log_format": "text",
                       "shutdown_grace_s": 5, "auth": {"token_env": "LORARL_AUTH_TOKEN", "required": True},
                       **self.server_sections.get(name, {})},
            service: section,
        }
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        ready = self.workdir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [*lorarl_command(), "serve", service, "--config", str(config_path), "--ready-file", str(ready)],
                stdout=log, stderr=subprocess.STDOUT, env={**self.env(), **self.process_env.get(name, {})},
                start_new_session=True)
        try:
            info = wait_for_ready_file(ready, timeout=self.start_timeout_s, process=process)
        except (RuntimeError, TimeoutError) as e:
            process.kill()
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} service did not start: {e}\n--- {log_path} ---\n{tail}") from None
        return ServiceProcess(name, process, info["address"], log_path, service)

    def stop(self) -> None:
        """SIGTERM everything (reverse start order), then SIGKILL whatever outlives the bound."""
        for name in reversed(list(self.processes)):
            proc = self.processes[name].process
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for svc in self.processes.values():
            remaining = max(0.1, deadline - time.monotonic())
            try:
                svc.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                os.killpg(svc.process.pid, signal.SIGKILL)
                svc.process.wait(timeout=10)
        self.processes.clear()

    def check_alive(self) -> None:
        for svc in self.processes.values():
            if svc.process.poll() is not None:
                tail = svc.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{svc.name} service exited with code {svc.process.returncode}\n{tail}")
