"""Runs Compose services as local processes: the same command and environment, other addresses.

Only what differs between a container network and one machine is rewritten: service host names
(and 0.0.0.0 / localhost) become 127.0.0.1, every port a server listens on becomes a free loopback
port, /app becomes this checkout (the image's WORKDIR holds a copy of it), volume mount points
become directories under a work folder, and a mounted secret (/run/secrets/NAME) its file. Config
files named by `--config` are rewritten the same way into that folder. The image's ENTRYPOINT
(`lorarl`) and healthcheck interpreter (`python3`) become this environment's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorarl.client.launch.local import LocalStack, ServiceProcess, lorarl_command
from lorarl.common.parent_watch import child_env
from lorarl.common.ports import free_port
from tools.compose_check import IMAGE_ROOT, ROOT, environment, parse_command, secret_mounts, service_config

_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9_.:\[\]-]+):(?P<port>\d+)")
_OVERRIDE = re.compile(r"(?P<key>[A-Za-z_][\w.-]*)=(?P<value>.*)")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
LOOPBACK = "127.0.0.1"


def duration_s(text: str | None, default: float) -> float:
    """A Compose duration ('1m30s', '300s', '500ms') in seconds."""
    if not text:
        return default
    return sum(float(n) * _UNITS[unit] for n, unit in _DURATION.findall(str(text)))


def image_entrypoint(dockerfile: Path) -> list[str]:
    """The exec-form ENTRYPOINT of a Dockerfile."""
    lines = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT")]
    return json.loads(lines[-1].removeprefix("ENTRYPOINT"))


def unused_port(taken: set[int]) -> int:
    """A free port none of ``taken``: the kernel can hand out the same free port twice in a row (two services of
    one project then met on one port)."""
    while (port := free_port()) in taken:
        pass
    return port


@dataclass
class Loopback:
    """Rewrites one Compose project's addresses, ports and paths for local processes (see module doc)."""

    project: Mapping[str, Any]
    workdir: Path
    hosts: frozenset[str] = frozenset()
    ports: dict[int, int] = field(default_factory=dict)
    paths: list[tuple[str, Path]] = field(default_factory=list)
    executables: dict[str, list[str]] = field(default_factory=dict)
    project_dir: Path = ROOT / "deploy"  # where the Compose file lies: secret files are relative to it

    def __post_init__(self) -> None:
        services = self.project["services"]
        self.hosts = frozenset({*services, "0.0.0.0", "::", "localhost", LOOPBACK})
        self.executables = {"lorarl": lorarl_command(), "python3": [sys.executable], "python": [sys.executable]}
        mounts: dict[str, Path] = {IMAGE_ROOT: ROOT}
        secrets: dict[str, Path] = {}
        for service in services.values():
            args = parse_command(service["command"])
            service_secrets = secret_mounts(self.project, service, self.project_dir)
            secrets.update(service_secrets)
            if args.command == "serve":
                config = service_config(service, args, service_secrets)
                for port in (config.server.port, config.server.metrics_port):
                    if port and port > 0 and port not in self.ports:
                        self.ports[port] = unused_port(set(self.ports.values()))
            for volume in service.get("volumes") or []:
                source, target = volume.split(":")[:2]
                mounts[target] = self.workdir / "volumes" / source if "/" not in source else Path(source)
        for path in mounts.values():
            path.mkdir(parents=True, exist_ok=True)
        self.paths = sorted({**mounts, **secrets}.items(), key=lambda item: -len(item[0]))

    # ------------------------------------------------------------------ values

    def text(self, value: str, *, is_host: bool = False) -> str:
        """A path, KEY=path override, host:port address or (when is_host) bare host, rewritten."""
        for prefix, local in self.paths:
            if value == prefix or value.startswith(prefix + "/"):
                return str(local) + value[len(prefix):]
        override = _OVERRIDE.fullmatch(value)
        if override and not value.startswith("-"):
            return f"{override['key']}={self.text(override['value'])}"
        address = _ADDRESS.fullmatch(value)
        if address and address["host"] in self.hosts:
            port = int(address["port"])
            if port not in self.ports:
                raise ValueError(f"{value}: port {port} is served by no service of the project")
            return f"{LOOPBACK}:{self.ports[port]}"
        if is_host and value in self.hosts:
            return LOOPBACK
        return value

    def data(self, value: Any, key: str = "") -> Any:
        """Config file data with every address, port and path rewritten."""
        if isinstance(value, str):
            return self.text(value, is_host=key.endswith("host"))
        if isinstance(value, int) and not isinstance(value, bool) and key in ("port", "metrics_port"):
            return self.ports.get(value, value)
        if isinstance(value, dict):
            return {k: self.data(v, str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.data(v, key) for v in value]
        return value

    # ------------------------------------------------------------------ a service

    def argv(self, name: str, words: list[str]) -> list[str]:
        """A command line: the executable mapped, each argument rewritten, --config files rewritten."""
        out = [*self.executables.get(words[0], [words[0]])]
        for index, word in enumerate(words[1:], start=1):
            local = self.text(word)
            if words[index - 1] == "--config":
                raw = yaml.safe_load(Path(local).read_text())
                local_file = self.workdir / "config" / f"{name}-{Path(local).name}"
                local_file.parent.mkdir(parents=True, exist_ok=True)
                local_file.write_text(yaml.safe_dump(self.data(raw), sort_keys=False))
                local = str(local_file)
            out.append(local)
        return out

    def command(self, name: str) -> list[str]:
        """The image's ENTRYPOINT plus the service's `command`, rewritten."""
        service = self.project["services"][name]
        dockerfile = Path(ROOT / "deploy", service["build"]["context"], service["build"]["dockerfile"])
        return self.argv(name, [*image_entrypoint(dockerfile), *service["command"]])

    def healthcheck(self, name: str) -> list[str]:
        test = self.project["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: only exec-form healthchecks run here, got {test}"
        return self.argv(name, list(test[1:]))

    def environment(self, name: str) -> dict[str, str]:
        """This process's environment without LORARL_* settings, plus the service's, rewritten."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("LORARL_")}
        env = environment(self.project["services"][name])
        return {**base, **{k: self.text(v, is_host=k.endswith("HOST")) for k, v in env.items()}}

    def working_dir(self, name: str) -> Path:
        return Path(self.text(self.project["services"][name].get("working_dir", IMAGE_ROOT)))


@dataclass
class LoopbackStack:
    """Starts Compose services as processes, each waited for with its own healthcheck; stops them all."""

    loopback: Loopback
    stop_timeout_s: float = 30.0
    stack: LocalStack = field(init=False)

    def __post_init__(self) -> None:
        # LocalStack's stop(): SIGTERM in reverse start order, then SIGKILL of the process group.
        self.stack = LocalStack(self.loopback.workdir, {}, stop_timeout_s=self.stop_timeout_s)

    def start(self, name: str) -> ServiceProcess:
        log_path = self.loopback.workdir / f"{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(self.loopback.command(name), cwd=self.loopback.working_dir(name),
                                       env={**self.loopback.environment(name), **child_env()}, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # gone with this test
        started = self.stack.processes[name] = ServiceProcess(name, process, "", log_path)
        self.wait_healthy(name)
        return started

    def wait_healthy(self, name: str) -> None:
        """Runs the healthcheck like Docker does during start_period, until it passes."""
        check = self.loopback.project["services"][name]["healthcheck"]
        probe = self.loopback.healthcheck(name)
        every = duration_s(check.get("start_interval") or check.get("interval"), 5.0)
        deadline = time.monotonic() + duration_s(check.get("start_period"), 0.0) + \
            duration_s(check.get("interval"), 30.0) * int(check.get("retries", 3))
        while True:
            self.stack.check_alive()
            result = subprocess.run(probe, capture_output=True, timeout=duration_s(check.get("timeout"), 30.0) + 10,
                                    env=self.loopback.environment(name), cwd=self.loopback.working_dir(name))
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy: {result.stderr.decode(errors='replace')}\n"
                                   f"{self.stack.processes[name].log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(every)

    def stop(self) -> dict[str, int]:
        """Stops every started service; their exit codes (0 after a graceful SIGTERM shutdown)."""
        processes = {name: svc.process for name, svc in self.stack.processes.items()}
        self.stack.stop()
        return {name: p.returncode for name, p in processes.items()}
