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
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from lorarl.common.auth import resolve_token
from lorarl.common.config import ConfigError, existing_file, in_range, setting
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
    state_file: str | None = setting(None, doc="Where the front keeps the tinker:// paths its clients saved, so they "
                                     "still load after a restart or a kill (lorarl.tinker.state; null: memory).")

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


async def serve_forever(config: TinkerFrontConfig) -> None:
    """The front until SIGTERM/SIGINT (exit code 0, as the gRPC services): HTTPS with ``server.tls`` when set, and
    its calls to the trainer and rollout secured by ``server.peer_tls`` as the services' own calls are."""
    from lorarl.common.channel import peer_tls
    from lorarl.common.http_server import start_http_server
    from lorarl.tinker.app import create_app
    from lorarl.tinker.service import TinkerService

    settings, server = config.tinker, config.server
    token = resolve_token(token_file=settings.token_file)
    try:
        service = TinkerService(settings.models, settings.trainer, settings.rollout, token=token,
                                session_ttl_s=settings.session_ttl_s, tls=peer_tls(server.peer_tls),
                                state_path=settings.state_file)
    except ValueError as e:  # a state file it cannot read: said, never replaced
        raise ConfigError("tinker.state_file", str(e)) from None
    app = create_app(service, settings.keys())
    web = await start_http_server(app, server.host, server.port, name="Tinker API", tls=server.tls, lifespan="on",
                                  log_level=server.log_level)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, web.request_stop)
    if server.ready_file:
        write_ready_file(server.ready_file, {"service": "tinker", "pid": os.getpid(), "port": web.port,
                                             "address": web.url})
    logger.info("serving the Tinker API on %s (trainer %s, rollout %s)", web.url, settings.trainer,
                settings.rollout or "none")
    try:
        await web.wait()
    finally:
        if server.ready_file:
            remove_ready_file(server.ready_file)
