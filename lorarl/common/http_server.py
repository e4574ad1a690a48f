"""The one way lorarl starts an HTTP server (the OpenAI-compatible endpoint, the Tinker front): uvicorn on a
socket bound here, in the caller's event loop, with the project's TLS settings, keep-alive and limits.

Bound before uvicorn starts: a port of 0 is known at once, and a taken port is a StartupError here rather than
uvicorn's ``sys.exit()`` inside the caller's loop. uvicorn's own SIGINT/SIGTERM handling is off: the process
that runs the server owns its signals (the rollout service drains its RPCs first; `lorarl serve tinker` stops
its front) and calls `stop`. TLS is the gRPC servers' (``server.tls``): HTTPS with their certificate, and client
certificates required for mutual TLS. Idle connections are kept KEEP_ALIVE_S (lorarl.common.http_keepalive).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn

from lorarl.common.http_keepalive import KEEP_ALIVE_S
from lorarl.common.server import StartupError
from lorarl.common.server_config import TlsConfig

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process running the server handles SIGTERM/SIGINT and calls stop()


def tls_options(tls: TlsConfig | None) -> dict[str, Any]:
    """uvicorn's TLS settings for ``server.tls`` (none when it is off)."""
    if tls is None or not tls.enabled:
        return {}
    options: dict[str, Any] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.client_ca_file:
        options.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def listening_socket(host: str, port: int, name: str) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), or a StartupError naming ``name`` and the address."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host.strip("[]"), port))
    except OSError as e:
        listener.close()
        raise StartupError(f"cannot serve the {name} on {host}:{port}: {e}") from None
    listener.set_inheritable(True)
    return listener


class HttpServer:
    """A started server: where it listens, its scheme, and how to stop it or wait for it."""

    def __init__(self, server: _Server, task: asyncio.Task[None], name: str, host: str) -> None:
        self._server, self._task, self.name = server, task, name
        self.port = int(server.servers[0].sockets[0].getsockname()[1])
        self.scheme = "https" if server.config.is_ssl else "http"
        self.url = f"{self.scheme}://{host}:{self.port}"

    def request_stop(self) -> None:
        """Asks the server to stop (safe from another thread: uvicorn polls the flag)."""
        self._server.should_exit = True

    async def wait(self) -> None:
        """Until the server has stopped."""
        await self._task

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.request_stop()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, timeout=timeout_s)


async def start_http_server(app: Any, host: str, port: int, *, name: str, tls: TlsConfig | None = None,
                            lifespan: str = "off", log_level: str = "warning",
                            limit_concurrency: int | None = None) -> HttpServer:
    """Serves ``app`` on ``host:port`` in this event loop; returns once it accepts connections. ``lifespan``:
    "on" runs the app's startup and shutdown events; ``limit_concurrency``: connections and tasks served at once
    (beyond: 503, which clients retry), None for uvicorn's unbounded default. StartupError when it cannot listen."""
    listener = listening_socket(host, port, name)
    config = uvicorn.Config(app, log_level=log_level, lifespan=lifespan, access_log=False,
                            timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=limit_concurrency,
                            **tls_options(tls))
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        if task.done():
            raise StartupError(f"cannot serve the {name} on {host}:{port}: "
                               f"{task.exception() or 'the server exited'}")
        await asyncio.sleep(0.02)
    running = HttpServer(server, task, name, host)
    logger.info("serving the %s on %s", name, running.url)
    return running
