"""The grpc.aio server bootstrap shared by trainer, rollout and weight sync.

`start_server` binds, adds health checking and reflection, installs the metrics, auth and error
interceptors, starts the Prometheus endpoint and writes the ready file; it returns a
`RunningServer` that tests drive in-process. `serve` does the same for a service process: it
configures logging, then runs until SIGTERM/SIGINT and shuts down gracefully — health turns
NOT_SERVING, new RPCs are refused, in-flight ones get `shutdown_grace_s` to finish (then are
cancelled), the service's `on_shutdown` hook runs, and the function returns so the process can
exit 0.

A service plugs in through `register(server) -> service names`, typically a call to the
generated `add_<X>ServiceServicer_to_server`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lorarl.common.auth import BearerAuthInterceptor, server_token
from lorarl.common.config import ConfigError
from lorarl.common.errors import ErrorInterceptor
from lorarl.common.gc_heap import freeze_long_lived
from lorarl.common.log import configure_logging
from lorarl.common.metrics import MetricsEndpoint, MetricsInterceptor, RpcMetrics, start_metrics_endpoint
from lorarl.common.ready import remove_ready_file, write_ready_file
from lorarl.common.server_config import ServerConfig

logger = logging.getLogger(__name__)

#: Adds a service's servicers to the server and returns their full names ("lorarl.v1.X").
Register = Callable[[grpc.aio.Server], Iterable[str]]
#: Releases a service's resources once RPCs have drained (may be sync or async).
ShutdownHook = Callable[[], Awaitable[None] | None]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StartupError(RuntimeError):
    """The server could not start (e.g. its port is taken); nothing is left running."""


class ServiceDiedError(RuntimeError):
    """What the service serves with died under it (e.g. vLLM's engine core): it stopped and must be restarted."""


def server_options(config: ServerConfig) -> list[tuple[str, Any]]:
    """Channel arguments for the server: message limits, keepalive, exclusive port binding."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        # Let clients keep idle connections and quiet calls alive with pings (see channel.channel_options).
        # gRPC's own default accepts one ping per 5 minutes without data and answers the second early
        # one with GOAWAY too_many_pings: every call quiet for ~2 minutes of 30 s pings would die.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(config.min_client_ping_interval_s * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        # Fail loudly if another process already listens on the port instead of sharing it.
        ("grpc.so_reuseport", 0),
    ]


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from config.tls; client certificates are required when client_ca_file is set."""
    tls = config.tls
    if not tls.enabled:
        return None
    assert tls.cert_file is not None and tls.key_file is not None  # validated by TlsConfig
    client_ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def format_address(host: str, port: int) -> str:
    """host:port, with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


@dataclass
class RunningServer:
    """A started server: where it listens, its health state, and how to stop it."""

    name: str
    config: ServerConfig
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    metrics: RpcMetrics
    service_names: tuple[str, ...]
    metrics_endpoint: MetricsEndpoint | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    on_shutdown: ShutdownHook | None = None
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _stopping: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return format_address(self.config.host, self.port)

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_endpoint.port if self.metrics_endpoint else None

    def ready_info(self) -> dict[str, Any]:
        """What the ready file holds."""
        return {
            "service": self.name,
            "pid": os.getpid(),
            "port": self.port,
            "metrics_port": self.metrics_port,
            "address": self.address,
            "tls": self.config.tls.enabled,
            "services": list(self.service_names),
            **self.extra,
        }

    async def set_serving(self, serving: bool, service: str | None = None) -> None:
        """Reports one service (or all, and the server as a whole) as SERVING or NOT_SERVING."""
        status = SERVING if serving else NOT_SERVING
        for name in [service] if service is not None else ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown, bounded by `grace` seconds (default: config.shutdown_grace_s).

        Safe to call more than once and from several tasks; all wait for the same shutdown.
        """
        if self._stopping is None:
            grace_s = self.config.shutdown_grace_s if grace is None else grace
            self._stopping = asyncio.ensure_future(self._shutdown(grace_s))
        await asyncio.shield(self._stopping)

    async def wait_for_termination(self) -> None:
        """Returns once stop() has completed."""
        await self._stopped.wait()

    async def _shutdown(self, grace_s: float) -> None:
        logger.info("shutting down", extra={"grace_s": grace_s})
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        try:
            if self.on_shutdown is not None:
                result = self.on_shutdown()
                if inspect.isawaitable(result):
                    await result
        except Exception:
            logger.exception("on_shutdown hook failed")
        finally:
            if self.metrics_endpoint is not None:
                await asyncio.to_thread(self.metrics_endpoint.close)  # waits for its poll loop
            if self.config.ready_file:
                remove_ready_file(self.config.ready_file)
            self._stopped.set()
            logger.info("stopped")


async def start_server(
    name: str,
    config: ServerConfig,
    register: Register,
    *,
    on_shutdown: ShutdownHook | None = None,
    metrics: RpcMetrics | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ready_extra: Mapping[str, Any] | None = None,
    before_ready: Callable[[RunningServer], Awaitable[None]] | None = None,
    also_tokens: Sequence[str] = (),
) -> RunningServer:
    """Starts a server for service `name` and reports it SERVING; see the module docstring. ``ready_extra``:
    more for the ready file (the rollout's OpenAI-compatible port). ``before_ready(running)`` runs once the
    port is bound, before SERVING and the ready file (the rollout subscribes to weight sync with its address).
    ``also_tokens``: keys accepted beside the server's token, which the service scopes itself (the trainer's
    per-job keys).

    Raises ConfigError (bad or missing token) or StartupError (cannot bind) before serving.
    """
    token = server_token(config.auth, host=config.host)
    metrics = metrics if metrics is not None else RpcMetrics()
    chain: list[grpc.aio.ServerInterceptor] = [MetricsInterceptor(metrics)]
    if token is not None:
        chain.append(BearerAuthInterceptor(token, token_hint=_token_hint(config), also=also_tokens))
    elif also_tokens:
        raise ConfigError("server.auth", "per-caller keys need the server's own token: set server.auth")
    else:
        logger.warning("authentication disabled (server.auth.required: false, loopback host %s)", config.host)
    chain += [ErrorInterceptor(), *interceptors]

    if config.ready_file:
        remove_ready_file(config.ready_file)
    server = grpc.aio.server(
        interceptors=chain,
        options=server_options(config),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    service_names = tuple(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    address = format_address(config.host, config.port)
    credentials = server_credentials(config)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {address}: {exc}") from None
    if not port:
        raise StartupError(f"cannot listen on {address}")
    await server.start()

    running = RunningServer(
        name=name,
        config=config,
        server=server,
        port=port,
        health=health_servicer,
        metrics=metrics,
        service_names=service_names,
        on_shutdown=on_shutdown,
        extra=dict(ready_extra or {}),
    )
    if config.metrics_enabled:
        assert config.metrics_port is not None
        try:
            running.metrics_endpoint = start_metrics_endpoint(config.metrics_host, config.metrics_port,
                                                              metrics.registry)
        except OSError as exc:
            await server.stop(0)
            where = format_address(config.metrics_host, config.metrics_port)
            raise StartupError(f"cannot serve metrics on {where}: {exc}") from None
    if before_ready is not None:
        try:
            await before_ready(running)
        except BaseException:
            if running.metrics_endpoint is not None:
                running.metrics_endpoint.close()
            await server.stop(0)
            raise
        running.extra.update(ready_extra or {})  # the hook may have filled it in
    await running.set_serving(True)
    if config.ready_file:
        write_ready_file(config.ready_file, running.ready_info())
    logger.info(
        "serving %s on %s",
        ", ".join(service_names) or name,
        running.address,
        extra={
            "port": port,
            "metrics_port": running.metrics_port,
            "tls": config.tls.enabled,
            "mutual_tls": config.tls.client_ca_file is not None,
            "auth": token is not None,
        },
    )
    return running


def _token_hint(config: ServerConfig) -> str:
    if config.auth.token_env and not (config.auth.token or config.auth.token_file):
        return f"${config.auth.token_env}"
    return "the server's auth configuration"


async def serve(
    name: str,
    config: ServerConfig,
    register: Register,
    on_shutdown: ShutdownHook | None = None,
    *,
    metrics: RpcMetrics | None = None,
    on_started: Callable[[RunningServer], Awaitable[None] | None] | None = None,
    watch: Callable[[], Awaitable[str]] | None = None,
    ready_extra: Mapping[str, Any] | None = None,
    before_ready: Callable[[RunningServer], Awaitable[None]] | None = None,
    also_tokens: Sequence[str] = (),
) -> None:
    """Runs service `name` until SIGTERM or SIGINT, then shuts down gracefully and returns.

    ``on_started(running)`` lets the service reach its running server (e.g. to report NOT_SERVING later).
    ``watch()`` returns (with the reason) once the service can no longer serve: health turns NOT_SERVING,
    the server stops and ServiceDiedError is raised, so the process exits non-zero and whatever supervises
    it (lorarl run, compose, Kubernetes) restarts it, instead of answering every call with an error.
    """
    configure_logging(name, level=config.log_level, fmt=config.log_format)
    # What start-up built (imports, a started engine) stays for the process's life: no collection should
    # walk it. Before the server starts, so the ready file never announces a process still collecting.
    freeze_long_lived()
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()

    def request_stop(signum: int) -> None:
        if stop_requested.is_set():
            logger.info("already shutting down", extra={"signal": signal.Signals(signum).name})
            return
        logger.info("received %s", signal.Signals(signum).name)
        stop_requested.set()

    # Handlers go in before the ready file is written: a supervisor may SIGTERM as soon as it reads it,
    # and the default action would kill the process mid-start instead of letting it stop cleanly.
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, request_stop, signum)
    try:
        running = await start_server(name, config, register, on_shutdown=on_shutdown, metrics=metrics,
                                     ready_extra=ready_extra, before_ready=before_ready, also_tokens=also_tokens)
        if on_started is not None:
            result = on_started(running)
            if inspect.isawaitable(result):
                await result
        # Also return when something else stopped the server. (Never cancel grpc's own
        # server.wait_for_termination(): that cancels the future its shutdown resolves.)
        waiters = {
            asyncio.ensure_future(stop_requested.wait()),
            asyncio.ensure_future(running.wait_for_termination()),
        }
        died = asyncio.ensure_future(watch()) if watch is not None else None
        if died is not None:
            waiters.add(died)
        _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in pending:
            waiter.cancel()
        if died is not None and died.done() and not died.cancelled():
            reason = died.result()
            logger.error("cannot serve any more: %s; stopping", reason)
            await running.set_serving(False)
            await running.stop(grace=min(1.0, config.shutdown_grace_s))  # what is in flight fails anyway
            raise ServiceDiedError(reason)
        await running.stop()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
