"""`lorarl run CONFIG launcher.kind=ray`: the job's services placed on a Ray cluster.

The same services, configs and token as the local stack, but each is a Ray actor (lorarl.client.launch.ray_host)
in a placement-group bundle: weight sync and the trainer share one node (STRICT_PACK; the trainer's bundle
holds its GPUs/NPUs and ``launcher.trainer_resources``), and the rollout replicas get one bundle each
(``tensor_parallel_size`` devices and ``launcher.rollout_resources``) spread as ``launcher.strategy``
says. The driver passes the addresses between them, streams every service's log into
``<output.dir>/services/``, writes where each one landed (``stack.json``) and tears everything down on
exit or Ctrl-C. What the cluster cannot give is refused before anything starts, naming the shortfall.

Paths in the services' configs (model, checkpoints, exports) are the driver's: on several machines they
must be on a filesystem every node mounts at the same place, as with Slurm or a Kubernetes volume.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorarl.client.launch.local import ServiceFailedError, Stack, metrics_url
from lorarl.client.launch.log_files import LogRetention, rotate_if_full
from lorarl.client.launch.ray_host import ServiceHost
from lorarl.common.config import ConfigError

logger = logging.getLogger(__name__)

POLL_S = 0.5
#: Ray's resource name for each trainer.device kind (CPU jobs ask for CPUs only).
ACCELERATOR = {"cuda": "GPU", "npu": "NPU"}


#: Ray dials a loopback cluster address at this host's external address unless told the cluster is one host.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray(address: str = "auto"):
    target = gcs_address(address) or ""
    if target.rpartition(":")[0].strip("[]") in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault(LOOPBACK_ENV, "0")  # a one-host cluster: stay on loopback
    try:
        import ray
    except ImportError:
        raise ConfigError("launcher.kind", "ray is not installed here: pip install 'lorarl[ray]' (or use "
                                           "launcher.kind=local)") from None
    return ray


def gcs_address(address: str) -> str | None:
    """host:port of the cluster to reach, or None for Ray's own 'auto' lookup with nothing in $RAY_ADDRESS."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")
    return address.removeprefix("ray://") or None


def connect(ray, address: str, timeout_s: float) -> None:
    """ray.init against the cluster; ConfigError naming the address when nothing answers there."""
    target = gcs_address(address)
    if target is not None:  # probe first: ray.init against a dead address retries for a long time
        host, _, port = target.rpartition(":")
        if not port.isdigit():
            raise ConfigError("launcher.address", f"{target!r} is not host:port")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 10)).close()
        except OSError as e:
            raise ConfigError("launcher.address", f"no Ray cluster answers at {target} ({e.strerror or e}); start "
                                                  "one with `ray start --head` or fix the address") from None
    try:
        ray.init(address=target or "auto", logging_level=logging.WARNING, log_to_driver=False,
                 configure_logging=False, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        tried = target or "auto ($RAY_ADDRESS unset: the cluster `ray start` began on this host)"
        raise ConfigError("launcher.address", f"could not connect to a Ray cluster at {tried}: "
                                              f"{str(e).splitlines()[0]}") from None


@dataclass(frozen=True)
class Bundles:
    """The placement groups' bundles: weight sync, trainer (one node), and one per rollout replica."""

    weightsync: dict[str, float]
    trainer: dict[str, float]
    rollout: dict[str, float]
    replicas: int

    def total(self) -> dict[str, float]:
        need: dict[str, float] = {}
        for bundle, count in ((self.weightsync, 1), (self.trainer, 1), (self.rollout, self.replicas)):
            for key, amount in bundle.items():
                need[key] = need.get(key, 0.0) + amount * count
        return need


def job_bundles(cfg) -> Bundles:
    launcher = cfg.launcher
    cpus = {"CPU": launcher.cpus_per_service}
    accelerator = ACCELERATOR.get(cfg.trainer.device.split(":", 1)[0])
    trainer = {**cpus, **launcher.trainer_resources}
    rollout = {**cpus, **launcher.rollout_resources}
    if accelerator:
        trainer[accelerator] = float(cfg.trainer.parallel.world_size)
        rollout[accelerator] = float(cfg.rollout.tensor_parallel_size)
    return Bundles(dict(cpus), trainer, rollout, cfg.rollout.replicas)


def check_resources(cfg, bundles: Bundles, have: dict[str, float], address: str) -> None:
    """ConfigError naming every resource the job needs more of than the whole cluster has."""
    short = []
    for key, amount in bundles.total().items():
        if have.get(key, 0.0) + 1e-9 < amount:
            why = ""
            if key in ACCELERATOR.values():
                why = (f" (trainer {cfg.trainer.parallel.world_size} + rollout {cfg.rollout.replicas} x "
                       f"{cfg.rollout.tensor_parallel_size})")
            short.append(f"{amount:g} {key}{why}, the cluster has {have.get(key, 0.0):g}")
    if short:
        raise ConfigError("launcher", f"the Ray cluster at {address} is short of what the job needs: "
                                      + "; ".join(short))


def check_fit(bundles: Bundles, nodes: list[dict[str, float]], address: str) -> None:
    """ConfigError when a bundle fits on no single node (a trainer's devices, one replica's TP group, weight sync
    beside the trainer): the totals may suffice while no node can hold it."""
    def fits(need: dict[str, float], node: dict[str, float]) -> bool:
        return all(node.get(k, 0.0) + 1e-9 >= v for k, v in need.items())

    head = {k: bundles.weightsync.get(k, 0.0) + bundles.trainer.get(k, 0.0)
            for k in {*bundles.weightsync, *bundles.trainer}}
    for what, need in (("weight sync + the trainer (one node)", head), ("a rollout replica", bundles.rollout)):
        if not any(fits(need, node) for node in nodes):
            largest = max(nodes, key=lambda n: sum(n.get(k, 0.0) for k in need), default={})
            raise ConfigError("launcher", f"no node of the Ray cluster at {address} can hold {what}: it needs "
                                          f"{need}, the largest node has "
                                          f"{ {k: largest.get(k, 0.0) for k in need} } (the trainer runs on one "
                                          "node; for one across nodes use `lorarl slurm` or torchrun)")


@dataclass
class RayService:
    name: str
    service: str
    actor: Any
    address: str = ""
    node_id: str = ""
    node_ip: str = ""
    pid: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    generation: int = 0  # the node log's rotations the stream has followed (log_files.read_since)
    offset: int = 0
    failure: str | None = None


@dataclass
class RayStack(Stack):
    """Duck-types LocalStack for `lorarl run`: start, addresses, supervise, failure, stop."""

    cfg: Any
    out: Path
    sections: dict[str, dict[str, Any]]
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    threads_per_service: int = 1
    stop_timeout_s: float = 30.0
    #: How much of each service log is kept, on the nodes and in the host's copy (output.service_log_*).
    log_retention: LogRetention = field(default_factory=LogRetention)
    services: dict[str, RayService] = field(default_factory=dict)
    failure: ServiceFailedError | None = None
    _groups: list[Any] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _streamer: threading.Thread | None = None
    _ray: Any = None

    @property
    def logs(self) -> Path:
        return self.out / "services"

    def address(self, name: str) -> str:
        if name == "rollout" and name not in self.services:
            name = "rollout-0"
        return self.services[name].address

    def addresses(self, service: str) -> list[str]:
        return [s.address for s in self.services.values() if s.service == service]

    def metrics_urls(self) -> dict[str, str]:
        """Each service's Prometheus endpoint on its node (output.prometheus; empty when off): a restarted service
        keeps its port."""
        return {s.name: metrics_url(self.cfg.output.prometheus_host, s.node_ip, s.info["metrics_port"])
                for s in self.services.values() if s.info.get("metrics_port")}

    def host_options(self) -> dict[str, Any]:
        """What every ServiceHost takes from the job beyond its own service: log retention, Prometheus metrics."""
        return {"log_retention": (self.log_retention.max_bytes, self.log_retention.backups),
                "metrics": self.cfg.output.prometheus, "metrics_host": self.cfg.output.prometheus_host}

    def openai_urls(self) -> list[str]:
        return [f"{s.info.get('openai_scheme', 'http')}://{s.node_ip}:{s.info['openai_port']}/v1"
                for s in self.services.values() if s.service == "rollout" and s.info.get("openai_port")]

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        launcher = self.cfg.launcher
        ray = self._ray = import_ray(launcher.address)
        bundles = job_bundles(self.cfg)
        connect(ray, launcher.address, launcher.connect_timeout_s)
        where = gcs_address(launcher.address) or "auto"
        check_resources(self.cfg, bundles, ray.cluster_resources(), where)
        check_fit(bundles, [n["Resources"] for n in ray.nodes() if n.get("Alive")], where)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        head = placement_group([bundles.weightsync, bundles.trainer], strategy="STRICT_PACK", name="lorarl-head")
        fleet = placement_group([bundles.rollout] * bundles.replicas, strategy=launcher.strategy,
                                name="lorarl-rollout")
        self._groups = [head, fleet]
        try:
            ray.get([head.ready(), fleet.ready()], timeout=launcher.place_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the Ray cluster at {where} did not grant the placement within {launcher.place_timeout_s:.0f} s "
                f"(launcher.place_timeout_s): weight sync + trainer {bundles.weightsync} + {bundles.trainer} on one "
                f"node, {bundles.replicas} x {bundles.rollout} ({launcher.strategy}); the cluster has "
                f"{ray.available_resources()} free") from None
        self.logs.mkdir(parents=True, exist_ok=True)
        token_file = self.logs / "token"  # for clients and extra replicas that join the run
        token_file.unlink(missing_ok=True)
        with os.fdopen(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(self.token)
        host = ray.remote(ServiceHost)
        workdir = Path(launcher.workdir or self.out / "services" / "nodes")

        def place(name: str, service: str, section: dict[str, Any], group, index: int,
                  bundle: dict[str, float]) -> RayService:
            resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            actor = host.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=resources,
                max_concurrency=4, scheduling_strategy=PlacementGroupSchedulingStrategy(group, index),
            ).remote(name, service, section, self.token, str(workdir / name), self.threads_per_service,
                     **self.host_options())
            self.services[name] = RayService(name, service, actor)
            return self.services[name]

        ws = place("weightsync", "weightsync", self.sections["weightsync"], head, 0, bundles.weightsync)
        self._started([ws])
        trainer = place("trainer", "trainer", {**self.sections["trainer"], "weightsync_address": ws.address},
                        head, 1, bundles.trainer)
        replicas = [place(f"rollout-{i}", "rollout", {**self.sections["rollout"], "replica_id": f"rollout-{i}",
                                                      "weightsync_address": ws.address}, fleet, i, bundles.rollout)
                    for i in range(bundles.replicas)]
        self._streamer = threading.Thread(target=self._stream, name="lorarl-ray-logs", daemon=True)
        self._streamer.start()
        self._started([trainer, *replicas])
        self._write_placement()
        for s in self.services.values():
            print(f"lorarl: {s.name} on Ray node {s.node_id[:12]} ({s.node_ip}) at {s.address}", flush=True)

    def _started(self, services: list[RayService]) -> None:
        """Starts them concurrently; RuntimeError naming the first that did not come up, with its log tail."""
        ray = self._ray
        calls = {s.name: s.actor.start.remote() for s in services}
        for s in services:
            try:
                info = ray.get(calls[s.name])
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None) or e
                raise RuntimeError(f"{s.name} on the Ray cluster: {cause}") from None
            s.address, s.node_id, s.node_ip, s.pid, s.info = (info["address"], info["node_id"], info["node_ip"],
                                                               info["pid"], info["info"])

    def _write_placement(self) -> None:
        nodes = {n["NodeID"]: n for n in self._ray.nodes()}
        metrics = self.metrics_urls()
        placement = {s.name: {"service": s.service, "address": s.address, "node_id": s.node_id, "node_ip": s.node_ip,
                              "pid": s.pid, "node_resources": nodes.get(s.node_id, {}).get("Resources", {}),
                              **({"metrics": metrics[s.name]} if s.name in metrics else {})}
                     for s in self.services.values()}
        (self.logs / "stack.json").write_text(json.dumps(placement, indent=2))

    # ------------------------------------------------------------------ supervision and logs

    def supervise(self, restarts: int) -> None:
        self._ray.get([s.actor.supervise.remote(restarts) for s in self.services.values()])

    def _stream(self) -> None:
        while not self._stopping.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """Appends each service's new log lines to <output.dir>/services/NAME.log; notes failures."""
        ray = self._ray
        for s in list(self.services.values()):
            try:
                chunk, s.generation, s.offset, failure, pid = ray.get(s.actor.poll.remote(s.generation, s.offset),
                                                                      timeout=10)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError as e:  # the actor (or its node) is gone
                chunk, failure, pid = b"", f"its Ray actor died ({type(e).__name__})", None
            if chunk:
                self.append_log(s.name, chunk)
            if pid is not None and s.pid is not None and pid != s.pid:  # restarted
                s.pid = pid
                self._write_placement_quietly()
            if failure and s.failure is None:
                s.failure = failure
                print(f"lorarl: {s.name}: {failure}", file=sys.stderr, flush=True)
                if s.service != "rollout":  # a lost replica leaves the fleet; the job goes on with the rest
                    self.failure = ServiceFailedError(f"{s.name} on Ray node {s.node_id[:12]}: {failure}")

    def _write_placement_quietly(self) -> None:
        try:
            self._write_placement()
        except Exception:  # a status file must not stop the log stream
            logger.debug("stack.json not rewritten", exc_info=True)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        self._stopping.set()
        ray = self._ray
        if ray is None or not ray.is_initialized():
            return
        if self._streamer is not None and self._streamer is not threading.current_thread():
            self._streamer.join(timeout=15)
        stopping = [s.actor.stop.remote() for s in reversed(list(self.services.values()))]
        try:
            ray.get(stopping, timeout=self.stop_timeout_s)
        except ray.exceptions.RayError as e:
            logger.warning("not every service stopped cleanly: %s", e)
        for s in self.services.values():
            try:
                self.poll_one_last(s)
            except Exception:
                logger.debug("last log lines of %s not read", s.name, exc_info=True)
            ray.kill(s.actor)
        from ray.util.placement_group import remove_placement_group

        for group in self._groups:
            remove_placement_group(group)
        (self.logs / "token").unlink(missing_ok=True)
        ray.shutdown()

    def poll_one_last(self, s: RayService) -> None:
        chunk, s.generation, s.offset, _, _ = self._ray.get(s.actor.poll.remote(s.generation, s.offset), timeout=10)
        if chunk:
            self.append_log(s.name, chunk)

    def append_log(self, name: str, chunk: bytes) -> None:
        """The host's copy of a service log (<output.dir>/services/NAME.log), kept under the same retention."""
        log = self.logs / f"{name}.log"
        with log.open("ab") as f:
            f.write(chunk)
        rotate_if_full(log, self.log_retention)

