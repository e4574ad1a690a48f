"""output.prometheus: every launcher's per-service config serves Prometheus metrics with the key (and none without),
on ports a scraper can find: free ones kept across restarts (`lorarl run`, Ray), fixed ones (`lorarl slurm`).
The real scrape of a running stack is in tests/e2e/test_faults.py."""

from __future__ import annotations

import inspect
import subprocess
from pathlib import Path

from lorarl.client.job.config import METRICS_PORT_OFFSET, load_job_config
from lorarl.client.launch.local import SERVICES, ServiceProcess, metrics_url
from lorarl.client.launch.ray_cluster import RayService, RayStack
from lorarl.client.launch.ray_host import ServiceHost
from lorarl.client.launch.services import local_stack, metrics_line
from lorarl.client.launch.slurm import ROLLOUT_PORT, TRAINER_PORT, WEIGHTSYNC_PORT, sbatch_script, service_configs
from lorarl.common.config import from_dict
from lorarl.common.server_config import ServerConfig


def cfg(*overrides: str):
    return load_job_config("examples/demo.yaml", list(overrides))


def server_of(config: dict) -> ServerConfig:
    """A service config's `server:` section as the service reads it (its token file aside: none exists here)."""
    return from_dict(ServerConfig, {k: v for k, v in config["server"].items() if k != "auth"})


def test_lorarl_run_turns_each_services_metrics_on_with_the_key(tmp_path: Path) -> None:
    off = local_stack(cfg(), tmp_path)
    assert not server_of(off.service_config("trainer", {})).metrics_enabled
    on = local_stack(cfg("output.prometheus=true", "output.prometheus_host=0.0.0.0"), tmp_path)
    for name in SERVICES:
        server = server_of(on.service_config(name, {}))
        assert server.metrics_enabled and server.metrics_port == 0 and server.metrics_host == "0.0.0.0"
    # a restart asks for the port the service had (LocalStack._restart passes its ready file's metrics_port)
    assert on.service_config("trainer", {}, port=5001, metrics_port=5002)["server"]["metrics_port"] == 5002
    # what `lorarl run` prints and writes to stack.json: each process's endpoint from its ready file
    dummy = subprocess.Popen(["true"])
    dummy.wait()
    on.processes["trainer"] = ServiceProcess("trainer", dummy, "10.0.0.7:5001", tmp_path / "t.log", "trainer",
                                             info={"metrics_port": 5002})
    on.processes["rollout"] = ServiceProcess("rollout", dummy, "10.0.0.7:5003", tmp_path / "r.log", "rollout",
                                             info={"metrics_port": None})  # a service serving none: left out
    assert on.metrics_urls() == {"trainer": "http://10.0.0.7:5002/metrics"}
    assert metrics_line(on, tmp_path).startswith("lorarl: Prometheus metrics at trainer http://10.0.0.7:5002/metrics")
    assert metrics_line(off, tmp_path) == ""


def test_metrics_urls_name_the_address_a_scraper_reaches() -> None:
    assert metrics_url("127.0.0.1", "node7", 9100) == "http://127.0.0.1:9100/metrics"  # loopback: on that node
    assert metrics_url("0.0.0.0", "node7", 9100) == "http://node7:9100/metrics"
    assert metrics_url("::", "fd00::1", 9100) == "http://[fd00::1]:9100/metrics"


def test_the_ray_launcher_hands_the_key_to_every_service_host(tmp_path: Path) -> None:
    stack = RayStack(cfg("launcher.kind=ray", "output.prometheus=true", "output.prometheus_host=0.0.0.0"), tmp_path,
                     {})
    options = stack.host_options()
    assert options["metrics"] is True and options["metrics_host"] == "0.0.0.0"
    inspect.signature(ServiceHost).bind("trainer", "trainer", {}, "token", str(tmp_path), 1, **options)
    stack.services["trainer"] = RayService("trainer", "trainer", None, node_ip="10.1.2.3", info={"metrics_port": 41})
    assert stack.metrics_urls() == {"trainer": "http://10.1.2.3:41/metrics"}
    assert RayStack(cfg("launcher.kind=ray"), tmp_path, {}).host_options()["metrics"] is False


def test_lorarl_slurm_serves_metrics_on_fixed_ports_and_says_where(tmp_path: Path) -> None:
    job = cfg("output.prometheus=true", "rollout.replicas=2")
    configs = service_configs(job, tmp_path)
    for service, port in (("weightsync", WEIGHTSYNC_PORT), ("trainer", TRAINER_PORT), ("rollout", ROLLOUT_PORT)):
        server = server_of(configs[service])
        assert server.metrics_enabled and server.metrics_port == port + METRICS_PORT_OFFSET
    script, _ = sbatch_script(job, "job.yaml", [], tmp_path)
    second = ROLLOUT_PORT + 10  # the second replica on the node: its own gRPC port, so its own metrics port
    assert f"server.port={second} server.metrics_port={second + METRICS_PORT_OFFSET}" in script
    assert '"server.ready_file=$RUN/services/rollout-1.ready.json"' in script
    (echo,) = [line for line in script.splitlines() if "Prometheus metrics at" in line]
    assert f"trainer http://127.0.0.1:{TRAINER_PORT + METRICS_PORT_OFFSET}/metrics on ${{NODES[0]}}" in echo
    assert script.index(echo) > script.index("ready ")  # said once the services are up
    off = service_configs(cfg(), tmp_path)
    assert off["trainer"]["server"]["metrics_port"] == -1
    assert "metrics" not in sbatch_script(cfg(), "job.yaml", [], tmp_path)[0]
