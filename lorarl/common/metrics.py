"""Prometheus metrics for RPCs, and the HTTP endpoint that exposes them.

Each server owns a `CollectorRegistry`, so several servers in one process (tests) stay apart and
services can add their own collectors to `RpcMetrics.registry`. Names and labels follow the
usual gRPC conventions (grpc_service, grpc_method, grpc_type, grpc_code).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from lorarl.common.handlers import RPC_TYPES, handler_kind, split_method, wrap_method_handler

#: Up to 10 minutes: a training step or a large weight transfer is one RPC.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RpcMetrics:
    """Started/handled counts, errors, latency and in-flight calls, per method."""

    def __init__(self, registry: CollectorRegistry | None = None, namespace: str = "lorarl") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ("grpc_service", "grpc_method", "grpc_type")
        self.started = Counter("rpc_started", "RPCs started.", labels, namespace=namespace, registry=self.registry)
        self.handled = Counter(
            "rpc_handled",
            "RPCs completed, by status code.",
            (*labels, "grpc_code"),
            namespace=namespace,
            registry=self.registry,
        )
        self.errors = Counter(
            "rpc_errors",
            "RPCs completed with a status other than OK.",
            (*labels, "grpc_code"),
            namespace=namespace,
            registry=self.registry,
        )
        self.latency = Histogram(
            "rpc_handling_seconds",
            "Time from the start of an RPC to its status, streams included.",
            labels,
            namespace=namespace,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "rpc_in_flight", "RPCs being handled.", labels, namespace=namespace, registry=self.registry
        )

    @asynccontextmanager
    async def observe(self, method: str, rpc_type: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Records one call of `method` ('/pkg.Service/Method') around the handler's body."""
        service, name = split_method(method)
        labels = (service, name, rpc_type)
        self.started.labels(*labels).inc()
        in_flight = self.in_flight.labels(*labels)
        in_flight.inc()
        start = time.perf_counter()
        code = grpc.StatusCode.UNKNOWN
        try:
            yield
            code = _code_of(context) or grpc.StatusCode.OK
        except grpc.aio.AbortError:
            code = _code_of(context) or grpc.StatusCode.UNKNOWN
            raise
        except (asyncio.CancelledError, GeneratorExit):
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = _code_of(context) or grpc.StatusCode.UNKNOWN
            raise
        finally:
            in_flight.dec()
            self.latency.labels(*labels).observe(time.perf_counter() - start)
            self.handled.labels(*labels, code.name).inc()
            if code is not grpc.StatusCode.OK:
                self.errors.labels(*labels, code.name).inc()


def _code_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    code = context.code()
    if code is None or isinstance(code, grpc.StatusCode):
        return code
    return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Records every call in `RpcMetrics`; install it first so rejected calls are counted too."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        rpc_type = RPC_TYPES[handler_kind(handler)]

        def around(context: grpc.aio.ServicerContext) -> AbstractAsyncContextManager[None]:
            return self._metrics.observe(method, rpc_type, context)

        return wrap_method_handler(handler, around)


@dataclass
class MetricsEndpoint:
    """A running Prometheus HTTP endpoint (GET /metrics) in a daemon thread."""

    host: str
    port: int
    _server: WSGIServer
    _thread: Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_endpoint(host: str, port: int, registry: CollectorRegistry) -> MetricsEndpoint:
    """Serves `registry` over HTTP on host:port (0 picks a free port; see .port)."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsEndpoint(host=host, port=int(server.server_port), _server=server, _thread=thread)
