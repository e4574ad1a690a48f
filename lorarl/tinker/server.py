"""`lorarl serve tinker`: the Tinker front as a service (HTTP, uvicorn) over running lorarl services.

    lorarl serve tinker --config tinker.yaml --port 8000

    # tinker.yaml
    tinker:
      trainer: 127.0.0.1:50051
      rollout: 127.0.0.1:50052
      models: {"Qwen/Qwen3-0.6B": /models/qwen3-0.6b}
      api_key_file: tinker.key     # one "tml-..." key per line

Clients then use ``tinker.ServiceClient(base_url="http://HOST:PORT", api_key=<the key>)``. ``server.port``
0 picks a free port, written with the address to ``server.ready_file`` as the gRPC services do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from lorarl.common.auth import resolve_token
from lorarl.common.config import ConfigError, existing_file, in_range, setting
from lorarl.common.http_keepalive import KEEP_ALIVE_S
from lorarl.common.ready import remove_ready_file, write_ready_file
from lorarl.common.server_config import ServerConfig
from lorarl.tinker.service import SESSION_TTL_S

logger = logging.getLogger(__name__)
KEY_PREFIX = "tml-"


@dataclass
class TinkerSettings:
    """Where the front sends its calls, what it serves, and the keys it accepts."""

    trainer: str = setting("", doc="The trainer service's address (host:port).")
    rollout: str = setting("", doc="A rollout service's address, for sampling (empty: training only).")
    models: dict[str, str] = setting(default_factory=dict, doc="Base-model name a client asks for (create_"
                                     "lora_training_client's base_model) -> its directory on the services.")
    api_keys: list[str] = setting(default_factory=list, doc="Keys a client may send in X-API-Key (each starting "
                                  f"{KEY_PREFIX!r}, as the Tinker SDK requires); prefer api_key_file.")
    api_key_file: str | None = setting(None, check=existing_file, doc="File with one key per line.")
    token_file: str | None = setting(None, check=existing_file, doc="The services' token (else $LORARL_AUTH_TOKEN).")
    session_ttl_s: float = setting(SESSION_TTL_S, check=in_range(1.0), doc="A session silent this long (no heartbeat"
                                   ", no call: a crashed client) expires: its models leave the trainer and rollout.")

    def validate(self) -> None:
        if not self.trainer:
            raise ConfigError("trainer", "is required: the trainer service's host:port")
        if not self.models:
            raise ConfigError("models", "names no base model: map a name clients use to a model directory")
        for key in self.keys():
            if not key.startswith(KEY_PREFIX):
                raise ConfigError("api_keys", f"every key must start with {KEY_PREFIX!r} (the Tinker SDK refuses "
                                              "other keys before sending them)")
        if not self.keys():
            raise ConfigError("api_keys", "no key: set tinker.api_key_file (or tinker.api_keys)")

    def keys(self) -> list[str]:
        found = list(self.api_keys)
        if self.api_key_file:
            found += [line.strip() for line in Path(self.api_key_file).read_text().splitlines() if line.strip()]
        return found


@dataclass
class TinkerFrontConfig:
    """The whole front config: `server:` (host, port, ready_file, logging) and `tinker:`."""

    server: ServerConfig = field(default_factory=ServerConfig)
    tinker: TinkerSettings = field(default_factory=TinkerSettings)


CONFIG_TYPE = TinkerFrontConfig


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before uvicorn starts: a port of 0 is known (and written) up front."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def serve_forever(config: TinkerFrontConfig) -> None:
    import uvicorn

    from lorarl.tinker.app import create_app
    from lorarl.tinker.service import TinkerService

    settings, server = config.tinker, config.server
    token = resolve_token(token_file=settings.token_file)
    service = TinkerService(settings.models, settings.trainer, settings.rollout, token=token,
                            session_ttl_s=settings.session_ttl_s)
    app = create_app(service, settings.keys())
    sock = bind(server.host, server.port)
    port = sock.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(app, log_level=server.log_level, access_log=False,
                                        timeout_keep_alive=KEEP_ALIVE_S))
    # SIGTERM / SIGINT end the front gracefully with exit code 0, as the gRPC services do (uvicorn's own
    # handlers re-raise the signal after shutting down, so the process would die of it).
    web.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(web, "should_exit", True))
    task = asyncio.create_task(web.serve(sockets=[sock]))
    while not web.started and not task.done():
        await asyncio.sleep(0.05)
    if server.ready_file and web.started:
        write_ready_file(server.ready_file, {"service": "tinker", "pid": os.getpid(), "port": port,
                                             "address": f"http://{server.host}:{port}"})
    logger.info("serving the Tinker API on http://%s:%d (trainer %s, rollout %s)", server.host, port,
                settings.trainer, settings.rollout or "none")
    try:
        await task
    finally:
        if server.ready_file:
            remove_ready_file(server.ready_file)
