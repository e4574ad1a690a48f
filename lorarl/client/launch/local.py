"""The three services on loopback, as their own processes, for `lorarl run`.

Each service is started exactly as a user (or the compose stack) would start it: `lorarl serve
<service> --config FILE`, here with free ports, a generated bearer token and a ready file that
reports the bound port. The stack stops every process it started, on success, failure or Ctrl-C:
SIGTERM first (services drain in-flight RPCs), SIGKILL after a bound.

``supervise`` watches them: a service that exits is restarted on the same port, with the same
config (the same storage, the same replica id), after a growing pause, a bounded number of times.
Whatever it left behind (a vLLM engine core, trainer ranks: its process group) is killed first, so
no child outlives its service. The loop meanwhile waits the restart out (lorarl.client.rl.recovery).
Each service watches the launcher (lorarl.common.parent_watch): a launcher killed by SIGKILL, which can stop
nothing, still leaves no service behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorarl.client.calls import TOKEN_FILE_ENV
from lorarl.client.launch.log_files import LogRetention, LogRotator
from lorarl.common.parent_watch import child_env
from lorarl.common.ports import free_port
from lorarl.common.ready import wait_for_ready_file
from lorarl.common.server_config import DEFAULT_TOKEN_ENV
from lorarl.contract import base_segment
from lorarl.platform import shared_memory

SERVICES = ("weightsync", "trainer", "rollout")
#: The services that compute on the base, so map the shared one when the job is co-located.
SHARES_BASE = ("trainer", "rollout")


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
    section: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0  # in a row: a process that stays up HEALTHY_UPTIME_S starts the count again
    info: dict[str, Any] = field(default_factory=dict)  # what its ready file said
    started_at: float = field(default_factory=time.monotonic)


def teacher_engine_process(teacher: str) -> str:
    """The process name of a full-model teacher's engine (a rollout service of its own)."""
    return f"teacher-{teacher}"


def is_teacher_engine(process: str) -> bool:
    return process.startswith("teacher-")


class ServiceFailedError(RuntimeError):
    """A supervised service kept exiting: restarts used up, or it did not come back."""


class Stack:
    """A set of services used as a context manager: started on entry, stopped on exit, and stopped again
    (whatever did start) when starting fails. LocalStack here, RayStack on a Ray cluster."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


RESTART_PAUSE_MIN_S, RESTART_PAUSE_MAX_S = 1.0, 30.0
#: A restarted service that then stays up this long is healthy: its restart count (recovery.restarts, the
#: restarts in a row a run survives) and pause start over. A crash loop still ends the run; a service killed
#: now and then over days does not.
HEALTHY_UPTIME_S = 60.0
WATCH_INTERVAL_S = 0.25


@dataclass
class LocalStack(Stack):
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
    #: Set by the supervisor when a service cannot be kept up; the loop's recovery reads it.
    failure: ServiceFailedError | None = None
    #: (process name, exit code, seconds from exit to serving again) per restart, for reports and benchmarks.
    restart_log: list[tuple[str, int, float]] = field(default_factory=list)
    #: The address every service binds and is reached at (a Ray node's own address under the Ray launcher).
    host: str = "127.0.0.1"
    #: output.prometheus: each service serves Prometheus metrics (GET /metrics) on a port of its own, free at its
    #: first start and the same after each restart (a scraper's target stays valid); False: none.
    metrics: bool = False
    #: output.prometheus_host: the address the metrics endpoints bind (no authentication: loopback by default).
    metrics_host: str = "127.0.0.1"
    #: How much of each service's log (NAME.log in workdir) is kept (output.service_log_mib / _backups).
    log_retention: LogRetention = field(default_factory=LogRetention)
    log_rotator: LogRotator = field(init=False)
    #: placement.colocate: the model directory whose base trainer and rollout share (one copy the launcher holds in
    #: an anonymous memory file; lorarl.platform.shared_memory); "": each service loads its own.
    shared_base_model: str = ""
    #: On-policy distillation's full-model teachers: name -> the rollout section of the engine that serves it (a
    #: process "teacher-<name>" beside the student's replicas, reached by them only: rollout.teacher_engines).
    teacher_engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    _shared_fd: int | None = None
    _watcher: threading.Thread | None = None
    _restarting: dict[str, threading.Thread] = field(default_factory=dict)  # per service: its restart under way
    _stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.log_rotator = LogRotator(self.log_paths, self.log_retention)

    def log_paths(self) -> list[Path]:
        return [svc.log_path for svc in list(self.processes.values())]

    def address(self, name: str) -> str:
        """A process's address; "rollout" names the first replica when there are several."""
        if name not in self.processes and name == "rollout" and "rollout-0" in self.processes:
            name = "rollout-0"
        return self.processes[name].address

    def addresses(self, service: str) -> list[str]:
        """Every process of ``service`` (all rollout replicas; not the teachers' engines), in start order."""
        return [p.address for p in self._processes_of(service)]

    def _processes_of(self, service: str) -> list[ServiceProcess]:
        """``service``'s processes, in start order; a full-model teacher's engine is a rollout service only the
        student's replicas reach, never one of the job's replicas."""
        return [p for n, p in self.processes.items() if p.service == service and not is_teacher_engine(n)]

    def metrics_urls(self) -> dict[str, str]:
        """Each process's Prometheus endpoint, as its ready file says (empty when output.prometheus is off)."""
        return {name: metrics_url(self.metrics_host, p.address.rsplit(":", 1)[0], p.info["metrics_port"])
                for name, p in self.processes.items() if p.info.get("metrics_port")}

    def openai_urls(self) -> list[str]:
        """Each rollout replica's OpenAI-compatible endpoint (rollout.openai_port), as now: a restarted
        replica may listen on another port."""
        return [f"{p.info.get('openai_scheme', 'http')}://{p.address.rsplit(':', 1)[0]}:{p.info['openai_port']}/v1"
                for p in self._processes_of("rollout") if p.info.get("openai_port")]

    def env(self) -> dict[str, str]:
        # The token goes to the services as a file (token_file), never in their environment.
        env = {k: v for k, v in os.environ.items() if k not in (DEFAULT_TOKEN_ENV, TOKEN_FILE_ENV)}
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        # Each service leaves when this launcher dies, by any signal (lorarl.common.parent_watch).
        env.update(child_env())
        # Three processes share the CPU: one OpenMP thread each. Two threads per process on a
        # 2-core machine made a training step 20x slower (threads spinning against each other).
        env.setdefault("OMP_NUM_THREADS", str(self.threads_per_service))
        return env

    @property
    def token_file(self) -> Path:
        return self.workdir / "token"

    def write_token(self) -> None:
        """The token in a file only its owner reads (0600), created so: never readable by others."""
        self.token_file.unlink(missing_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token)

    def start(self) -> None:
        """Starts every service at once and waits for all: the rollout's engine (~15 s on CPU) no longer waits
        for weight sync's and the trainer's start-up (~6 s on CPU) before its own. Weight sync's port is
        picked here, so the others know its address before it is up (the trainer connects at its first
        CreateJob, the rollout subscribes with retries)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.write_token()
        ports: dict[str, int] = {}
        if "weightsync" in self.services:
            ports["weightsync"] = free_port(self.host)
        launches: list[tuple[str, dict[str, Any], str, int]] = []  # (process name, section, service, port)
        if self.shared_base_model:
            self._build_shared_base()
        teacher_ports = {name: free_port(self.host) for name in self.teacher_engines}
        launches += [(teacher_engine_process(name), section, "rollout", teacher_ports[name])
                     for name, section in self.teacher_engines.items()]
        for name in self.services:
            section = dict(self.sections.get(name, {}))
            if name == "rollout" and teacher_ports:
                section["teacher_engines"] = {n: f"{self.host}:{port}" for n, port in teacher_ports.items()}
            if name in SHARES_BASE and self._shared_fd is not None:
                section["shared_base"] = shared_memory.path_of(self._shared_fd)
            if name in ("trainer", "rollout") and "weightsync" in ports:
                section.setdefault("weightsync_address", f"{self.host}:{ports['weightsync']}")
            if name == "rollout" and self.rollout_replicas > 1:
                launches += [(f"rollout-{i}", {**section, "replica_id": f"rollout-{i}"}, "rollout", 0)
                             for i in range(self.rollout_replicas)]
                continue
            launches.append((name, section, name, ports.get(name, 0)))
        spawned = [self._spawn(name, section, service, port) for name, section, service, port in launches]
        try:
            for process in spawned:
                self.processes[process.name] = self._await_ready(process)
        except BaseException:
            for process in spawned:
                if process.name not in self.processes:
                    _kill_group(process.process.pid)
            raise
        self.write_addresses()
        self.log_rotator.start()

    def _build_shared_base(self) -> None:
        """The one copy of the base, written once, before any service starts: a restarted service maps it again.
        Only this process holds its descriptor (and each service, given it at spawn): when they all exit, however
        they end, the kernel frees it."""
        fd = shared_memory.create()
        try:
            started = time.monotonic()
            size = base_segment.build(fd, self.shared_base_model)
        except BaseException:
            os.close(fd)
            raise
        self._shared_fd = fd
        print(f"lorarl: shared base {size / 2**20:.1f} MiB in memory, one copy for the trainer and the rollout "
              f"({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)

    def write_addresses(self) -> None:
        """The services' addresses in ``stack.json`` beside the token: what `lorarl run --attach` reads to run
        another job on this stack."""
        addresses = {"trainer": self.address("trainer") if "trainer" in self.processes else None,
                     "weightsync": self.address("weightsync") if "weightsync" in self.processes else None,
                     "rollout": self.addresses("rollout"), "openai": self.openai_urls(),
                     # what a job that attaches must fit in: the rollout's LoRA rank and adapter slots, and what
                     # its engine serves as adapters (its ready file's word: lorarl.contract.sharing.EngineLora)
                     **{key: self.sections.get("rollout", {}).get(key) for key in ("max_lora_rank", "max_loras")},
                     "lora": next((p.info["lora"] for p in self._processes_of("rollout") if "lora" in p.info), None),
                     "metrics": self.metrics_urls()}
        (self.workdir / "stack.json").write_text(json.dumps(addresses, indent=1) + "\n")

    def _launch(self, name: str, section: dict[str, Any], service: str = "", port: int = 0,
                metrics_port: int = 0) -> ServiceProcess:
        return self._await_ready(self._spawn(name, section, service, port, metrics_port))

    def service_config(self, name: str, section: dict[str, Any], service: str = "", port: int = 0,
                       metrics_port: int = 0) -> dict[str, Any]:
        """The config file of process ``name``: its service's ``section`` under a `server:` section that binds
        ``port`` (0: a free one), takes the stack's token and, with ``metrics``, serves Prometheus metrics on
        ``metrics_port`` (0: a free one)."""
        service = service or name
        return {
            "server": {"host": self.host, "port": port, "metrics_port": metrics_port if self.metrics else -1,
                       **({"metrics_host": self.metrics_host} if self.metrics else {}), "log_format": "text",
                       "shutdown_grace_s": 5, "auth": {"token_file": str(self.token_file), "token_env": None,
                                                         "required": True},
                       **self.server_sections.get(name, {})},
            service: section,
        }

    def _spawn(self, name: str, section: dict[str, Any], service: str = "", port: int = 0,
               metrics_port: int = 0) -> ServiceProcess:
        """The service's process, started; its address is known once it is ready (``_await_ready``)."""
        service = service or name
        config = self.service_config(name, section, service, port, metrics_port)
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        ready = self._ready_file(name)
        ready.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [*lorarl_command(), "serve", service, "--config", str(config_path), "--ready-file", str(ready)],
                stdout=log, stderr=subprocess.STDOUT, env={**self.env(), **self.process_env.get(name, {})},
                start_new_session=True,
                pass_fds=(self._shared_fd,) if "shared_base" in section and self._shared_fd is not None else ())
        return ServiceProcess(name, process, "", log_path, service, section)

    def _ready_file(self, name: str) -> Path:
        return self.workdir / f"{name}.ready.json"

    def _await_ready(self, started: ServiceProcess) -> ServiceProcess:
        """``started`` with its address, once its ready file is written; RuntimeError with its log's tail when
        it exits or times out first (the process is killed)."""
        try:
            info = wait_for_ready_file(self._ready_file(started.name), timeout=self.start_timeout_s,
                                       process=started.process)
        except (RuntimeError, TimeoutError) as e:
            _kill_group(started.process.pid)
            tail = started.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{started.name} service did not start: {e}\n--- {started.log_path} ---\n{tail}") \
                from None
        started.address, started.info = info["address"], info
        started.started_at = time.monotonic()  # uptime counts from serving (a slow start is not time up)
        return started

    # ------------------------------------------------------------------ supervision

    def supervise(self, restarts: int) -> None:
        """Restarts any service that exits, at most ``restarts`` times each (0: a dead service fails the run)."""
        self._watcher = threading.Thread(target=self._watch, args=(restarts,), name="lorarl-supervisor",
                                         daemon=True)
        self._watcher.start()

    def _watch(self, restarts: int) -> None:
        """Polls the services; each one found dead comes back in its own thread (`_restart`), side by side with
        any other: a service whose start needs another (the rollout subscribes to weight sync before it is
        ready) must never wait for a restart queued behind its own."""
        while not self._stopping.wait(WATCH_INTERVAL_S):
            if self.failure is not None:
                return
            for name, svc in list(self.processes.items()):
                restarting = self._restarting.get(name)
                if restarting is not None and restarting.is_alive():
                    continue
                code = svc.process.poll()
                if code is None and svc.restarts and time.monotonic() - svc.started_at >= HEALTHY_UPTIME_S:
                    svc.restarts = 0
                if code is None or self._stopping.is_set():
                    continue
                thread = threading.Thread(target=self._restart, args=(name, svc, code, restarts),
                                          name=f"lorarl-restart-{name}", daemon=True)
                self._restarting[name] = thread
                thread.start()

    def _restart(self, name: str, svc: ServiceProcess, code: int, restarts: int) -> None:
        """``svc`` (exited with ``code``) again on its own port, after a pause that doubles with its restarts in a
        row; past ``restarts`` of them, the stack's failure. A start that fails counts as another exit: the
        watcher finds the service still dead and calls again."""
        died = time.monotonic()
        _kill_group(svc.process.pid)  # its engine core, its ranks
        if svc.restarts >= restarts:
            self.failure = ServiceFailedError(
                f"the {name} service exited with code {code} and was restarted {svc.restarts} times "
                f"already (recovery.restarts); see {svc.log_path}")
            print(f"lorarl: {self.failure}", file=sys.stderr, flush=True)
            return
        pause = min(RESTART_PAUSE_MAX_S, RESTART_PAUSE_MIN_S * 2 ** svc.restarts)
        print(f"lorarl: the {name} service exited with code {code}; restarting it on {svc.address} "
              f"({svc.restarts + 1} of {restarts}) in {pause:.0f} s", file=sys.stderr, flush=True)
        if self._stopping.wait(pause):
            return
        try:
            fresh = self._launch(name, svc.section, svc.service, port=int(svc.address.rsplit(":", 1)[1]),
                                 metrics_port=int(svc.info.get("metrics_port") or 0))
        except RuntimeError as e:  # did not come up: counts as another exit
            svc.restarts += 1
            print(f"lorarl: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            return
        if self._stopping.is_set():  # the stack stopped while this one started
            _kill_group(fresh.process.pid)
            fresh.process.wait(timeout=10)
            return
        fresh.restarts = svc.restarts + 1
        self.processes[name] = fresh
        self.restart_log.append((name, code, time.monotonic() - died))
        print(f"lorarl: the {name} service is back ({time.monotonic() - died:.1f} s after it exited)",
              file=sys.stderr, flush=True)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        """SIGTERM everything (reverse start order), then SIGKILL whatever outlives the bound."""
        self._stopping.set()
        self.log_rotator.stop()
        for thread in [self._watcher, *self._restarting.values()]:  # a restart under way ends first
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=self.start_timeout_s + 5)
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
            _kill_group(svc.process.pid)  # nothing it started outlives it
        self.processes.clear()
        self.token_file.unlink(missing_ok=True)  # the secret does not outlive the stack either
        if self._shared_fd is not None:  # the shared base goes with its last holder: every service is gone now
            os.close(self._shared_fd)
            self._shared_fd = None

    def check_alive(self) -> None:
        for svc in self.processes.values():
            if svc.process.poll() is not None:
                tail = svc.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{svc.name} service exited with code {svc.process.returncode}\n{tail}")


def metrics_url(bind_host: str, node_host: str, port: int) -> str:
    """Where a scraper reaches a service's metrics endpoint: at the address it binds, or at its node's own address
    when it binds every interface (0.0.0.0, ::)."""
    host = node_host if bind_host in ("0.0.0.0", "::", "[::]") else bind_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


def _kill_group(pgid: int) -> None:
    """SIGKILLs what is left of a service's process group (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
