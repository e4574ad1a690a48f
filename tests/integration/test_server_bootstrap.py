"""The shared server bootstrap, in-process over loopback: draining, deadlines, errors, TLS.

Each test runs its own event loop (asyncio.run) with a test servicer whose handlers sleep,
fail or stream, so the behaviour of lorarl.common.server is observable from a real client.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorarl.common.channel import ClientTls, aio_channel
from lorarl.common.config import from_dict
from lorarl.common.errors import FIELD_METADATA_KEY, InvalidArgumentError, NotFoundError
from lorarl.common.ready import read_ready_file
from lorarl.common.server import RunningServer, StartupError, start_server
from lorarl.common.server_config import ServerConfig
from lorarl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

TOKEN = "bootstrap-test-token"
SERVICE = "lorarl.v1.TrainerService"

pytestmark = pytest.mark.timeout(60)


class JobBook:
    """A stand-in delegate: plain Python, raising plain lorarl errors."""

    def create(self, job_id: str) -> str:
        if not job_id:
            raise InvalidArgumentError("job_id", "must not be empty")
        return job_id

    def accept(self, job_id: str, count: int) -> int:
        if job_id == "missing":
            raise NotFoundError(f"no job {job_id!r}")
        return count


class ProbeServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Handlers that sleep, fail or stream, and record whether they were cancelled."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.book = JobBook()
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.finished = asyncio.Event()
        self.deadline_seen: float | None = None

    async def GetJob(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        self.deadline_seen = context.time_remaining()
        self.started.set()
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished.set()
        return trainer_pb2.GetJobResponse(job=trainer_pb2.JobStatus(job_id=request.job_id))

    async def CreateJob(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        job_id = self.book.create(request.job_id)
        return trainer_pb2.CreateJobResponse(job=trainer_pb2.JobStatus(job_id=job_id))

    async def DeleteJob(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return {}["bug"]  # an unexpected error

    async def PushTrajectories(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for request in request_iterator:
            accepted = self.book.accept(request.job_id, len(request.trajectories))
            yield trainer_pb2.PushTrajectoriesResponse(accepted=accepted)


def server_config(**overrides: Any) -> ServerConfig:
    data: dict[str, Any] = {"port": 0, "auth": {"token": TOKEN}, "shutdown_grace_s": 5.0}
    data.update(overrides)
    return from_dict(ServerConfig, data)


def registration(servicer: ProbeServicer) -> Callable[[grpc.aio.Server], list[str]]:
    def register(server: grpc.aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
        return [SERVICE]

    return register


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def handled(running: RunningServer, method: str, code: str) -> float:
    value = running.metrics.registry.get_sample_value(
        "lorarl_rpc_handled_total",
        {"grpc_service": SERVICE, "grpc_method": method, "grpc_type": "unary", "grpc_code": code},
    )
    return value or 0.0


def test_stop_drains_in_flight_rpc_and_refuses_new_ones(tmp_path: Path) -> None:
    async def scenario() -> None:
        servicer = ProbeServicer(delay_s=0.8)
        ready = tmp_path / "ready.json"
        # A grace far above the call's 0.8 s: stopping waits for the call, not the grace (robust under load).
        running = await start_server("trainer", server_config(ready_file=str(ready), shutdown_grace_s=30),
                                     registration(servicer))
        assert read_ready_file(ready)["port"] == running.port
        async with aio_channel(running.address, token=TOKEN) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            call = asyncio.ensure_future(stub.GetJob(trainer_pb2.GetJobRequest(job_id="slow"), timeout=10))
            await asyncio.wait_for(servicer.started.wait(), 5)
            start = time.monotonic()
            stopping = asyncio.ensure_future(running.stop())
            await asyncio.sleep(0.1)
            async with aio_channel(running.address, token=TOKEN) as late_channel:
                late = trainer_pb2_grpc.TrainerServiceStub(late_channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await late.GetJob(trainer_pb2.GetJobRequest(job_id="late"), timeout=2)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            response = await call  # the in-flight call completes normally
            assert response.job.job_id == "slow"
            await stopping
            elapsed = time.monotonic() - start
        assert servicer.finished.is_set() and not servicer.cancelled.is_set()
        assert 0.5 < elapsed < 15.0
        assert not ready.exists()  # removed on shutdown

    run(scenario)


def test_grace_bounds_the_drain_and_cancels_stragglers() -> None:
    async def scenario() -> None:
        servicer = ProbeServicer(delay_s=60)
        running = await start_server("trainer", server_config(shutdown_grace_s=0.5), registration(servicer))
        async with aio_channel(running.address, token=TOKEN) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            call = asyncio.ensure_future(stub.GetJob(trainer_pb2.GetJobRequest(job_id="stuck")))
            await asyncio.wait_for(servicer.started.wait(), 5)
            start = time.monotonic()
            await running.stop()
            elapsed = time.monotonic() - start
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            assert failed.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert servicer.cancelled.is_set()
        assert elapsed < 15.0  # the 0.5 s grace, not the straggler's 60 s (slack for a loaded machine)

    run(scenario)


def test_deadline_reaches_the_handler_and_cancels_it() -> None:
    async def scenario() -> None:
        servicer = ProbeServicer(delay_s=60)
        running = await start_server("trainer", server_config(), registration(servicer))
        try:
            async with aio_channel(running.address, token=TOKEN) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.GetJob(trainer_pb2.GetJobRequest(job_id="x"), timeout=0.5)
                assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await asyncio.wait_for(servicer.cancelled.wait(), 5)
            # the caller's 0.5 s, as the server's clock reads it (grpc rounds the deadline: 0.5004 was seen)
            assert servicer.deadline_seen is not None and 0 < servicer.deadline_seen <= 0.51
            assert handled(running, "GetJob", "DEADLINE_EXCEEDED") == 1
        finally:
            await running.stop()

    run(scenario)


def test_delegate_errors_become_statuses_and_metrics() -> None:
    async def scenario() -> None:
        running = await start_server("trainer", server_config(), registration(ProbeServicer()))
        try:
            async with aio_channel(running.address, token=TOKEN) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                created = await stub.CreateJob(trainer_pb2.CreateJobRequest(job_id="a"))
                assert created.job.job_id == "a"

                call = stub.CreateJob(trainer_pb2.CreateJobRequest(job_id=""))
                with pytest.raises(grpc.aio.AioRpcError) as invalid:
                    await call
                assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert invalid.value.details() == "job_id: must not be empty"
                assert (FIELD_METADATA_KEY, "job_id") in tuple(await call.trailing_metadata())

                with pytest.raises(grpc.aio.AioRpcError) as internal:
                    await stub.DeleteJob(trainer_pb2.DeleteJobRequest(job_id="a"))
                assert internal.value.code() == grpc.StatusCode.INTERNAL
                assert "KeyError" in (internal.value.details() or "")

                with pytest.raises(grpc.aio.AioRpcError) as unimplemented:
                    await stub.ListJobs(trainer_pb2.ListJobsRequest())
                assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED

                # A bidirectional stream keeps the responses sent before the failure.
                requests = [
                    trainer_pb2.PushTrajectoriesRequest(job_id="a", trajectories=[common_pb2.Trajectory()] * 2),
                    trainer_pb2.PushTrajectoriesRequest(job_id="missing"),
                ]
                received = []
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    async for response in stub.PushTrajectories(iter(requests)):
                        received.append(response.accepted)
                assert received == [2]
                assert missing.value.code() == grpc.StatusCode.NOT_FOUND
                assert missing.value.details() == "no job 'missing'"
            assert handled(running, "CreateJob", "OK") == 1
            assert handled(running, "CreateJob", "INVALID_ARGUMENT") == 1
            assert handled(running, "DeleteJob", "INTERNAL") == 1
            assert handled(running, "ListJobs", "UNIMPLEMENTED") == 1
            errors = running.metrics.registry.get_sample_value(
                "lorarl_rpc_errors_total",
                {
                    "grpc_service": SERVICE,
                    "grpc_method": "PushTrajectories",
                    "grpc_type": "bidi_stream",
                    "grpc_code": "NOT_FOUND",
                },
            )
            assert errors == 1
        finally:
            await running.stop()

    run(scenario)


def test_set_serving_reports_per_service_health() -> None:
    async def scenario() -> None:
        running = await start_server("trainer", server_config(), registration(ProbeServicer()))
        try:
            async with aio_channel(running.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)

                async def status(service: str) -> int:
                    return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

                assert await status(SERVICE) == health_pb2.HealthCheckResponse.SERVING
                await running.set_serving(False, SERVICE)
                assert await status(SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await status("") == health_pb2.HealthCheckResponse.SERVING
                await running.set_serving(True)
                assert await status(SERVICE) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await running.stop()

    run(scenario)


def test_port_in_use_is_a_startup_error() -> None:
    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(StartupError, match=str(port)):
                await start_server("trainer", server_config(port=port), registration(ProbeServicer()))
            with pytest.raises(StartupError, match="metrics"):
                await start_server("trainer", server_config(metrics_port=port), registration(ProbeServicer()))
        # Two lorarl servers never share a port (gRPC enables SO_REUSEPORT by default).
        first = await start_server("trainer", server_config(), registration(ProbeServicer()))
        try:
            with pytest.raises(StartupError, match=str(first.port)):
                await start_server("trainer", server_config(port=first.port), registration(ProbeServicer()))
        finally:
            await first.stop()

    run(scenario)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    from tests.integration.tls_certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


async def health_code(target: str, tls: ClientTls | None) -> grpc.StatusCode:
    """OK if a health check gets through, else the failure's status code."""
    async with aio_channel(target, tls=tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_tls_accepts_tls_clients_only(pki) -> None:
    async def scenario() -> None:
        config = server_config(tls={"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)})
        running = await start_server("trainer", config, registration(ProbeServicer()))
        try:
            tls = ClientTls(ca_file=str(pki.ca))
            assert await health_code(running.address, tls) == grpc.StatusCode.OK
            assert await health_code(f"localhost:{running.port}", tls) == grpc.StatusCode.OK
            assert await health_code(running.address, None) == grpc.StatusCode.UNAVAILABLE
            async with aio_channel(running.address, token=TOKEN, tls=tls) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                response = await stub.GetJob(trainer_pb2.GetJobRequest(job_id="over-tls"))
                assert response.job.job_id == "over-tls"
        finally:
            await running.stop()

    run(scenario)


def test_mutual_tls_requires_a_trusted_client_certificate(pki) -> None:
    async def scenario() -> None:
        config = server_config(
            tls={
                "cert_file": str(pki.server_cert),
                "key_file": str(pki.server_key),
                "client_ca_file": str(pki.ca),
            }
        )
        running = await start_server("trainer", config, registration(ProbeServicer()))
        try:
            trusted = ClientTls(ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key))
            rogue = ClientTls(ca_file=str(pki.ca), cert_file=str(pki.rogue_cert), key_file=str(pki.rogue_key))
            assert await health_code(running.address, trusted) == grpc.StatusCode.OK
            assert await health_code(running.address, ClientTls(ca_file=str(pki.ca))) == grpc.StatusCode.UNAVAILABLE
            assert await health_code(running.address, rogue) == grpc.StatusCode.UNAVAILABLE
            assert await health_code(running.address, None) == grpc.StatusCode.UNAVAILABLE
        finally:
            await running.stop()

    run(scenario)


SIGNAL_AT_READY = """
import asyncio, os, signal, sys
from lorarl.common.config import from_dict
from lorarl.common.server import serve
from lorarl.common.server_config import ServerConfig

config = from_dict(ServerConfig, {"port": 0, "ready_file": sys.argv[1], "shutdown_grace_s": 1,
                                 "auth": {"required": False}})
# SIGTERM the moment the server is up and its ready file written, before serve() goes on.
terminate_self = lambda running: os.kill(os.getpid(), signal.SIGTERM)
asyncio.run(serve("trainer", config, lambda server: [], on_started=terminate_self))
print("returned")
"""


def test_sigterm_right_after_the_ready_file_stops_cleanly(tmp_path: Path) -> None:
    """A supervisor may SIGTERM as soon as the ready file appears; the default action would kill the process."""
    ready = tmp_path / "ready.json"
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_AT_READY, str(ready)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "returned"
    assert "received SIGTERM" in done.stderr
    assert not ready.exists()


GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length far past the end: no protobuf parser accepts it


def test_a_body_that_does_not_parse_is_invalid_argument_and_only_after_authentication() -> None:
    async def scenario() -> None:
        running = await start_server("trainer", server_config(), registration(ProbeServicer()))
        try:
            async with aio_channel(running.address, token=TOKEN) as channel:
                get_job = channel.unary_unary(f"/{SERVICE}/GetJob")  # no serializer: the bytes go as they are
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await get_job(GARBAGE, timeout=5)
                assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid lorarl.v1.GetJobRequest" in unary.value.details()
                push = channel.stream_stream(f"/{SERVICE}/PushTrajectories")
                with pytest.raises(grpc.aio.AioRpcError) as streamed:
                    async for _ in push(iter([GARBAGE]), timeout=5):
                        pass
                assert streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid lorarl.v1.PushTrajectoriesRequest" in streamed.value.details()
                # a well-formed body still reaches the handler
                ok = await get_job(trainer_pb2.GetJobRequest(job_id="j").SerializeToString(), timeout=5)
                assert trainer_pb2.GetJobResponse.FromString(ok).job.job_id == "j"
            async with aio_channel(running.address) as anonymous:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await anonymous.unary_unary(f"/{SERVICE}/GetJob")(GARBAGE, timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # not a parse error: nothing leaks
                assert "GetJobRequest" not in refused.value.details()
        finally:
            await running.stop(0)

    run(scenario)


def listening(ports: set[int]) -> set[tuple[str, int]]:
    """(address, port) of this process's listening TCP sockets on ``ports``."""
    from tests.listeners import listening_addresses

    return {(address, port) for address, port, pid in listening_addresses(os.getpid())
            if pid == os.getpid() and port in ports}


def test_no_listener_on_an_interface_the_configuration_did_not_name() -> None:
    """The gRPC port and the (unauthenticated) metrics port bind the configured hosts only."""
    async def scenario() -> None:
        running = await start_server("trainer", server_config(metrics_port=0), registration(ProbeServicer()))
        try:
            ports = {running.port, running.metrics_port}
            assert listening(ports) == {("127.0.0.1", running.port), ("127.0.0.1", running.metrics_port)}
        finally:
            await running.stop(0)
        wide = await start_server("trainer", server_config(metrics_port=0, metrics_host="0.0.0.0"),
                                  registration(ProbeServicer()))
        try:
            assert ("0.0.0.0", wide.metrics_port) in listening({wide.metrics_port})  # only when asked for
            assert listening({wide.port}) == {("127.0.0.1", wide.port)}
        finally:
            await wide.stop(0)

    run(scenario)


def test_a_service_whose_engine_dies_stops_and_raises_instead_of_serving_errors() -> None:
    """serve(watch=...): once the watch returns, the server stops and ServiceDiedError ends the process
    (`lorarl serve` exits 1), so a supervisor restarts it instead of it answering every call with an error."""
    from lorarl.common.server import ServiceDiedError, serve

    config = from_dict(ServerConfig, {"port": 0, "shutdown_grace_s": 5, "auth": {"required": False}})
    seen: dict[str, Any] = {}
    engine_dead = asyncio.Event()

    async def on_started(running: RunningServer) -> None:
        seen["address"] = running.address

        async def probe_then_kill() -> None:
            seen["before"] = await health_code(running.address, None)
            engine_dead.set()

        seen["probe"] = asyncio.ensure_future(probe_then_kill())

    async def watch() -> str:
        await engine_dead.wait()
        return "the engine core died"

    async def scenario() -> None:
        started = time.monotonic()
        with pytest.raises(ServiceDiedError, match="the engine core died"):
            await serve("rollout", config, lambda server: [], on_started=on_started, watch=watch)
        seen["stop_s"] = time.monotonic() - started
        seen["after"] = await health_code(seen["address"], None)

    asyncio.run(scenario())
    assert seen["before"] == grpc.StatusCode.OK
    assert seen["after"] == grpc.StatusCode.UNAVAILABLE  # nothing listens any more
    assert seen["stop_s"] < 4  # not the whole 5 s grace: what is in flight fails anyway
