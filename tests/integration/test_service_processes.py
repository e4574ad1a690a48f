"""`lorarl serve <service>` as real processes on loopback: ports, health, reflection, auth,
metrics, structured logs, SIGTERM shutdown, configuration errors and mutual TLS."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from lorarl.common.channel import ClientTls, sync_channel
from lorarl.common.cpu_affinity import available_cpus
from lorarl.common.ready import wait_for_ready_file
from lorarl.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weightsync_pb2, weightsync_pb2_grpc

TOKEN = "process-test-token"
GRACE_S = 1.0
#: Seconds allowed beyond the grace period for the process to exit (interpreter teardown etc.).
EXIT_SLACK_S = 10.0  # a loaded 2-core machine tears an interpreter with torch down slowly

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Service:
    name: str
    full_name: str
    section: dict[str, Any]
    # Makes one RPC (with the channel's credentials) that the service refuses with `expected`.
    call: Callable[[grpc.Channel], Any]
    expected: grpc.StatusCode = grpc.StatusCode.UNIMPLEMENTED
    # Text the refusal must contain (default: the method name).
    detail: str = ""

    @property
    def method(self) -> str:
        return self.call.__name__


def GetJob(channel: grpc.Channel) -> Any:  # noqa: N802 - named after the RPC it makes
    return trainer_pb2_grpc.TrainerServiceStub(channel).GetJob(trainer_pb2.GetJobRequest(job_id="no-such-job"),
                                                               timeout=5)


def GetCapabilities(channel: grpc.Channel) -> Any:  # noqa: N802
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    return stub.GetCapabilities(rollout_pb2.GetCapabilitiesRequest(), timeout=5)


def GetManifest(channel: grpc.Channel) -> Any:  # noqa: N802
    stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
    return stub.GetManifest(weightsync_pb2.GetManifestRequest(job_id="no-such-job"), timeout=5)


SERVICES = [
    Service("trainer", "lorarl.v1.TrainerService", {"trainer": {"device": "cpu"}}, GetJob,
            grpc.StatusCode.NOT_FOUND, "no-such-job"),
    # No model_path: the replica serves without an engine and says so.
    Service("rollout", "lorarl.v1.RolloutService", {"rollout": {"max_loras": 2}}, GetCapabilities,
            grpc.StatusCode.FAILED_PRECONDITION, "rollout.model_path"),
    Service("weightsync", "lorarl.v1.WeightSyncService", {"weightsync": {"keep_versions": 2}}, GetManifest,
            grpc.StatusCode.NOT_FOUND, "no-such-job"),
]


def lorarl_command() -> list[str]:
    script = Path(sys.executable).with_name("lorarl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lorarl.client.cli"]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORARL_")}
    env.update(extra)
    return env


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    ready_file: Path
    info: dict[str, Any]

    @property
    def address(self) -> str:
        return self.info["address"]

    def terminate(self, timeout: float) -> tuple[int, float, str]:
        """SIGTERM; returns (exit code, seconds to exit, stderr)."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            _, stderr = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate()
            pytest.fail(f"server did not exit within {timeout:.1f} s of SIGTERM:\n{stderr}")
        return self.process.returncode, time.monotonic() - start, stderr


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Starts `lorarl serve` processes and makes sure none outlives the test."""
    started: list[subprocess.Popen[str]] = []

    def start(service: str, config: dict[str, Any], *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        config_file = tmp_path / f"{service}-{len(started)}.yaml"
        config_file.write_text(yaml.safe_dump(config))
        ready_file = tmp_path / f"{service}-{len(started)}.ready.json"
        command = [*lorarl_command(), "serve", service, "--config", str(config_file), "--ready-file", str(ready_file)]
        process = subprocess.Popen(
            [*command, *args],
            env=env if env is not None else child_env(LORARL_AUTH_TOKEN=TOKEN),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        try:
            info = wait_for_ready_file(ready_file, timeout=30, process=process)
        except RuntimeError:
            pytest.fail(f"server exited early:\n{process.communicate()[1]}")
        return ServerProcess(process, ready_file, info)

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something else is listening on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def health_status(channel: grpc.Channel, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def reflected_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    return [s.name for response in responses for s in response.list_services_response.service]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def handled_count(samples: dict, service: Service, code: str) -> float:
    labels = {"grpc_service": service.full_name, "grpc_method": service.method, "grpc_type": "unary", "grpc_code": code}
    return samples.get(("lorarl_rpc_handled_total", tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_service_process_lifecycle(service: Service, launch, busy_port: int) -> None:
    # The file asks for a port that is taken; --port 0 must override it (flags beat the file),
    # and LORARL_SERVER__LOG_FORMAT switches logs to JSON (the environment beats the file).
    config = {
        "server": {"port": busy_port, "shutdown_grace_s": GRACE_S, "metrics_port": -1, "log_format": "text"},
        **service.section,
    }
    env = child_env(LORARL_AUTH_TOKEN=TOKEN, LORARL_SERVER__LOG_FORMAT="json")
    server = launch(service.name, config, "--port", "0", "--metrics-port", "0", env=env)
    info = server.info
    assert info["service"] == service.name
    assert info["pid"] == server.process.pid
    assert info["port"] not in (0, busy_port)
    assert info["metrics_port"] > 0
    assert info["address"] == f"127.0.0.1:{info['port']}"

    with sync_channel(server.address) as anonymous:
        # Health checking needs no token.
        assert health_status(anonymous) == health_pb2.HealthCheckResponse.SERVING
        assert health_status(anonymous, service.full_name) == health_pb2.HealthCheckResponse.SERVING
        # Everything else does.
        missing = rpc_error(lambda: service.call(anonymous))
        assert missing.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing credentials" in missing.details() and TOKEN not in missing.details()
        assert rpc_error(lambda: reflected_services(anonymous)).code() == grpc.StatusCode.UNAUTHENTICATED

    with sync_channel(server.address, token="not-" + TOKEN) as wrong:
        bad = rpc_error(lambda: service.call(wrong))
        assert bad.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "invalid bearer token" in bad.details() and TOKEN not in bad.details()

    with sync_channel(server.address, token=TOKEN) as authorised:
        refused = rpc_error(lambda: service.call(authorised))
        assert refused.code() == service.expected
        assert (service.detail or service.method) in refused.details()
        listed = reflected_services(authorised)
        assert service.full_name in listed
        assert "grpc.health.v1.Health" in listed

    samples = scrape(info["metrics_port"])
    assert handled_count(samples, service, "UNAUTHENTICATED") == 2
    assert handled_count(samples, service, service.expected.name) == 1
    assert handled_count(samples, service, "OK") == 0

    # An open health watch is an in-flight stream: it sees NOT_SERVING, and the process still
    # exits 0 once the grace period has run out.
    with sync_channel(server.address) as watcher:
        updates = health_pb2_grpc.HealthStub(watcher).Watch(health_pb2.HealthCheckRequest(service=service.full_name))
        assert next(updates).status == health_pb2.HealthCheckResponse.SERVING
        code, seconds, stderr = server.terminate(timeout=GRACE_S + EXIT_SLACK_S)
        assert next(updates).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert code == 0, stderr
    assert seconds < GRACE_S + EXIT_SLACK_S
    assert not server.ready_file.exists()

    logs = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert logs, stderr
    messages = [entry["msg"] for entry in logs]
    assert any(m.startswith(f"serving {service.full_name}") for m in messages)
    assert "received SIGTERM" in messages and "stopped" in messages
    assert all(entry["service"] == service.name for entry in logs)


def test_idle_server_exits_promptly_on_sigterm(launch) -> None:
    server = launch("trainer", {"server": {"shutdown_grace_s": 30}})
    code, seconds, stderr = server.terminate(timeout=20)
    assert code == 0, stderr
    assert seconds < 15  # nothing in flight: no need to wait out the 30 s grace period


def test_cpu_nice_lowers_every_thread_of_the_service(launch) -> None:
    """server.cpu_nice is applied before any thread starts, so the gRPC and worker threads inherit it."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    server = launch("trainer", {"server": {"cpu_nice": 7}})
    pid = server.process.pid
    threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    assert len(threads) > 1
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {min(base + 7, 19)}
    code, _, stderr = server.terminate(timeout=10)
    assert code == 0, stderr


@pytest.mark.skipif(len(available_cpus()) < 2, reason="needs two CPUs to tell pinned from unpinned")
def test_server_cpus_pins_every_thread_of_the_service(launch) -> None:
    """server.cpus is applied before the server starts its threads: gRPC, worker and library threads all
    run on the CPU asked for (the trainer `lorarl run` pins on CPU jobs)."""
    target = available_cpus()[-1]
    server = launch("trainer", {"server": {"cpus": str(target)}})
    pid = server.process.pid
    threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    assert len(threads) > 1
    assert {tuple(sorted(os.sched_getaffinity(t))) for t in threads} == {(target,)}
    code, _, stderr = server.terminate(timeout=10)
    assert code == 0, stderr


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--set", "server.prot=1"], "server.prot"),
        (["--set", "server.cpu_nice=20"], "server.cpu_nice"),
        (["--set", "server.cpus=1-0"], "server.cpus"),
        (["--set", "server.cpus=4096"], "server.cpus"),
        (["--port", "70000"], "server.port"),
        (["--set", "trainer.device=gpu"], "trainer.device"),
        (["--set", "server.tls.cert_file=/no/such/cert.pem"], "server.tls.cert_file"),
        (["--set", "server.auth.required=true"], "server.auth.required"),
        # fail closed: no token and no opt-out, or the opt-out on a host other machines reach
        ([], "server.auth.required"),
        (["--set", "server.auth.required=false", "--set", "server.host=0.0.0.0"], "server.auth.required"),
    ],
)
def test_bad_configuration_exits_2_naming_the_key(args: list[str], key: str, tmp_path: Path) -> None:
    ready_file = tmp_path / "ready.json"
    result = subprocess.run(
        [*lorarl_command(), "serve", "trainer", "--ready-file", str(ready_file), *args],
        env=child_env(),  # no token in the environment
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert f"invalid configuration: {key}:" in result.stderr
    assert not ready_file.exists()


def test_port_in_use_exits_1(busy_port: int, tmp_path: Path) -> None:
    result = subprocess.run(
        [*lorarl_command(), "serve", "weightsync", "--port", str(busy_port)],
        env=child_env(LORARL_AUTH_TOKEN=TOKEN),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{busy_port}" in result.stderr


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    from tests.integration.tls_certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


def test_mutual_tls_process(launch, pki) -> None:
    config = {
        "server": {
            "tls": {
                "cert_file": str(pki.server_cert),
                "key_file": str(pki.server_key),
                "client_ca_file": str(pki.ca),
            },
            "shutdown_grace_s": GRACE_S,
        }
    }
    server = launch("trainer", config)
    assert server.info["tls"] is True
    trusted = ClientTls(ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    with sync_channel(server.address, token=TOKEN, tls=trusted) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        assert rpc_error(lambda: GetJob(channel)).code() == grpc.StatusCode.NOT_FOUND
    for tls in (ClientTls(ca_file=str(pki.ca)), None):  # no client certificate; plaintext
        with sync_channel(server.address, token=TOKEN, tls=tls) as channel:
            assert rpc_error(lambda: health_status(channel)).code() == grpc.StatusCode.UNAVAILABLE
    code, _, stderr = server.terminate(timeout=GRACE_S + EXIT_SLACK_S)
    assert code == 0, stderr
