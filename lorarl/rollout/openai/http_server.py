"""The OpenAI-compatible endpoint's HTTP server: uvicorn in the rollout's own event loop, on its own port.

In the rollout's loop, the handlers call the core directly (no second process, no gRPC hop). uvicorn's
``serve`` would take SIGINT/SIGTERM for itself; the rollout service owns them (it drains in-flight RPCs and
stops this server with it), so the server here leaves signals alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from lorarl.common.http_keepalive import KEEP_ALIVE_S
from lorarl.common.server import StartupError
from lorarl.common.server_config import TlsConfig
from lorarl.contract.chat import ChatRenderer
from lorarl.rollout.core import RolloutCore
from lorarl.rollout.openai.app import Endpoint, create_app
from lorarl.rollout.openai.sessions import SessionStore

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the rollout service handles SIGTERM/SIGINT and stops this server


class OpenAIServer:
    """A started endpoint: where it listens, and how to stop it."""

    def __init__(self, server: _Server, task: asyncio.Task[None], endpoint: Endpoint) -> None:
        self._server, self._task, self.endpoint = server, task, endpoint
        self.port = int(server.servers[0].sockets[0].getsockname()[1])
        self.scheme = "https" if server.config.is_ssl else "http"

    async def stop(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, timeout=10)


async def start_openai_server(core: RolloutCore, host: str, port: int, token: str | None,
                              max_sessions: int = 4096, tls: TlsConfig | None = None) -> OpenAIServer:
    """Serves /v1/* for ``core`` on ``host:port`` (0: any free port), over HTTPS with the gRPC server's
    certificate when ``tls`` is on (and client certificates required for mutual TLS, as there); StartupError
    when it cannot listen."""
    model_dir = Path(core.info.model_path)
    # the core's renderer where it has one: one tokenizer per rollout process, whichever API asks
    renderer = core.renderer.chat if core.renderer is not None else ChatRenderer(str(model_dir))
    endpoint = Endpoint(core, renderer, SessionStore(max_sessions), token, model_dir.name)
    _ = endpoint.renderer.tokenizer  # loaded before the first request
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # bound here: uvicorn would sys.exit() on a taken port, inside this service's event loop
        listener.bind((host.strip("[]"), port))
    except OSError as e:
        listener.close()
        raise StartupError(f"cannot serve the OpenAI-compatible endpoint on {host}:{port}: {e}") from None
    secure: dict = {}
    if tls is not None and tls.enabled:
        secure = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
        if tls.client_ca_file:
            secure.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(create_app(endpoint), log_level="warning", lifespan="off", access_log=False,
                            timeout_keep_alive=KEEP_ALIVE_S, **secure)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        if task.done():
            raise StartupError(f"cannot serve the OpenAI-compatible endpoint on {host}:{port}: "
                               f"{task.exception() or 'the server exited'}")
        await asyncio.sleep(0.02)
    running = OpenAIServer(server, task, endpoint)
    logger.info("serving the OpenAI-compatible endpoint on http://%s:%d/v1", host, running.port)
    return running
