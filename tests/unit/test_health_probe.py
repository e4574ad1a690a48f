"""The container healthcheck probe against a real gRPC server with the standard health service."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lorarl.common.health_probe import main, probe
from lorarl.common.ports import free_port

SERVICE = "lorarl.v1.TrainerService"


@pytest.fixture
def server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        grpc_server.stop(0)




def test_serving_server_passes(server: tuple[str, health.HealthServicer]) -> None:
    target, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert probe(target) and probe(target, SERVICE)
    assert main([target, "--service", SERVICE]) == 0


def test_not_serving_or_unknown_service_fails(server: tuple[str, health.HealthServicer]) -> None:
    target, servicer = server
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert not probe(target, SERVICE)
    assert not probe(target, "lorarl.v1.NoSuchService")  # NOT_FOUND
    assert main([target, "--service", SERVICE]) == 1


def test_nothing_listening_fails_within_the_timeout() -> None:
    assert main([f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1
