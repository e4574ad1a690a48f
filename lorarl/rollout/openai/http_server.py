"""The OpenAI-compatible endpoint's HTTP server, in the rollout's own event loop, on its own port (started by
lorarl.common.http_server, as the Tinker front is).

In the rollout's loop, the handlers call the core directly (no second process, no gRPC hop). The rollout service
owns SIGINT/SIGTERM (it drains in-flight RPCs and stops this server with it).
"""

from __future__ import annotations

from pathlib import Path

from lorarl.common.http_server import HttpServer, start_http_server
from lorarl.common.server_config import TlsConfig
from lorarl.contract.chat import ChatRenderer
from lorarl.rollout.core import RolloutCore
from lorarl.rollout.openai.app import Endpoint, create_app
from lorarl.rollout.openai.sessions import SessionStore


class OpenAIServer:
    """A started endpoint: the HTTP server (where it listens, how to stop it) and the endpoint it serves."""

    def __init__(self, http: HttpServer, endpoint: Endpoint) -> None:
        self.http, self.endpoint = http, endpoint
        self.port, self.scheme = http.port, http.scheme

    async def stop(self) -> None:
        await self.http.stop()


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
    http = await start_http_server(create_app(endpoint), host, port, name="OpenAI-compatible endpoint", tls=tls)
    return OpenAIServer(http, endpoint)
