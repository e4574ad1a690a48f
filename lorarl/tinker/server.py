"""`lorarl serve tinker`: the Tinker front as a service (HTTP, uvicorn) over running lorarl services.

    lorarl serve tinker --config tinker.yaml --port 8000

    # tinker.yaml
    tinker:
      trainer: 127.0.0.1:50051
      rollout: 127.0.0.1:50052
      models: {"Qwen/Qwen3-0.6B": /models/qwen3-0.6b}
      api_key_file: tinker.key     # one "tml-..." key per line: one tenant, "default", shared by their holders
      tenants:                     # teams that must not see or crowd out each other (lorarl.tinker.tenants)
        - name: team-a
          api_key_file: team-a.key
          trainer_token_file: team-a.trainer-key   # its trainer.tenants key, jobs ['tinker-team-a-*']
          max_models: 4
          max_in_flight: 8

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
from lorarl.tinker.tenants import DEFAULT_TENANT, NAME, FrontTenant, FrontTenants, TenantLimits

logger = logging.getLogger(__name__)
KEY_PREFIX = "tml-"


_LIMITS = TenantLimits()


def read_keys(api_keys: list[str], api_key_file: str | None) -> list[str]:
    """The keys listed in a config, then those in its key file, one per line (blank lines skipped)."""
    found = list(api_keys)
    if api_key_file:
        found += [line.strip() for line in Path(api_key_file).read_text().splitlines() if line.strip()]
    return found


@dataclass
class TenantSettings:
    """One team on the front: its keys, what it may hold, and its key on the trainer (lorarl.tinker.tenants)."""

    name: str = setting("", doc="The tenant's name: lower-case letters, digits and '-' (its trainer jobs are "
                        "named tinker-<name>-...).")
    api_keys: list[str] = setting(default_factory=list, doc="Its keys (each starting 'tml-'); prefer api_key_file.")
    api_key_file: str | None = setting(None, check=existing_file, doc="File with its keys, one per line.")
    trainer_token_file: str | None = setting(None, check=existing_file, doc="Its key on the trainer (one of "
                                             "trainer.tenants, jobs ['tinker-<name>-*']): the trainer then confines "
                                             "its calls to its jobs and shares its base by tenant. Else the front's "
                                             "service token.")
    trainer_token_env: str = setting("", doc="Environment variable holding that trainer key instead.")
    max_models: int = setting(_LIMITS.max_models, check=in_range(1), doc="Training models it may have at once.")
    max_sampling_models: int = setting(_LIMITS.max_sampling_models, check=in_range(1),
                                       doc="Its models (and restored sampler paths) the rollout may hold for "
                                           "sampling at once: its adapter slots there.")
    max_in_flight: int = setting(_LIMITS.max_in_flight, check=in_range(1),
                                 doc="Its requests running at the trainer and rollout at once; the rest wait.")
    max_waiting: int = setting(_LIMITS.max_waiting, check=in_range(0),
                               doc="Its requests that may wait behind those; past it a request gets HTTP 429 "
                                   "(the SDK waits Retry-After and retries).")

    def validate(self) -> None:
        if not NAME.match(self.name or ""):
            raise ConfigError("name", f"{self.name!r}: lower-case letters, digits and '-', at most 32 (it goes into "
                                      "the tenant's trainer job ids)")
        if self.name == DEFAULT_TENANT:
            raise ConfigError("name", f"{DEFAULT_TENANT!r} is the tenant of tinker.api_keys; name this one otherwise")
        if not self.key_list():
            raise ConfigError("api_keys", f"tenant {self.name!r} has no key: set api_key_file (or api_keys)")

    def key_list(self) -> list[str]:
        return read_keys(self.api_keys, self.api_key_file)

    def tenant(self) -> FrontTenant:
        token = resolve_token(token_file=self.trainer_token_file, token_env=self.trainer_token_env or None)
        if (self.trainer_token_file or self.trainer_token_env) and not token:
            raise ConfigError(f"tenants[{self.name}].trainer_token_env", f"${self.trainer_token_env} is not set")
        return FrontTenant(self.name, tuple(self.key_list()), TenantLimits(self.max_models, self.max_sampling_models,
                                                                       self.max_in_flight, self.max_waiting),
                           trainer_token=token)


@dataclass
class TinkerSettings:
    """Where the front sends its calls, what it serves, and the keys it accepts."""

    trainer: str = setting("", doc="The trainer service's address (host:port).")
    rollout: str = setting("", doc="A rollout service's address, for sampling (empty: training only).")
    models: dict[str, str] = setting(default_factory=dict, doc="Base-model name a client asks for (create_"
                                     "lora_training_client's base_model) -> its directory on the services.")
    api_keys: list[str] = setting(default_factory=list, doc="Keys a client may send in X-API-Key (each starting "
                                  f"{KEY_PREFIX!r}, as the Tinker SDK requires); prefer api_key_file. Together one "
                                  f"tenant, {DEFAULT_TENANT!r}, with the default limits: its holders share everything.")
    api_key_file: str | None = setting(None, check=existing_file, doc="File with one key per line.")
    tenants: list[TenantSettings] = setting(default_factory=list, doc="Teams, each with its own keys and limits: "
                                            "none sees, samples, trains, loads or deletes another's models, samplers "
                                            "or tinker:// paths, and each waits in its own queue.")
    token_file: str | None = setting(None, check=existing_file, doc="The services' token (else $LORARL_AUTH_TOKEN).")
    session_ttl_s: float = setting(SESSION_TTL_S, check=in_range(1.0), doc="A session silent this long (no heartbeat"
                                   ", no call: a crashed client) expires: its models leave the trainer and rollout.")
    state_file: str | None = setting(None, doc="Where the front keeps its state — the tinker:// paths its clients "
                                     "saved, sessions, models, sampling sessions — and, beside it, a journal of its "
                                     "requests, so its clients carry on after a restart or a kill "
                                     "(lorarl.tinker.state; null: memory).")

    def validate(self) -> None:
        if not self.trainer:
            raise ConfigError("trainer", "is required: the trainer service's host:port")
        if not self.models:
            raise ConfigError("models", "names no base model: map a name clients use to a model directory")
        every = self.keys() + [k for t in self.tenants for k in t.key_list()]
        for key in every:
            if not key.startswith(KEY_PREFIX):
                raise ConfigError("api_keys", f"every key must start with {KEY_PREFIX!r} (the Tinker SDK refuses "
                                              "other keys before sending them)")
        if not every:
            raise ConfigError("api_keys", "no key: set tinker.api_key_file (or tinker.api_keys, or tinker.tenants)")
        if len(set(every)) != len(every):
            raise ConfigError("tenants", "a key is listed twice; each key belongs to one tenant")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError("tenants", f"two tenants share a name: {sorted(names)}")

    def front_tenants(self) -> FrontTenants:
        """The default tenant (the plain keys, when there are any) and each configured one."""
        plain = [FrontTenant(DEFAULT_TENANT, tuple(self.keys()))] if self.keys() else []
        return FrontTenants(plain + [t.tenant() for t in self.tenants])

    def keys(self) -> list[str]:
        return read_keys(self.api_keys, self.api_key_file)


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
                                state_path=settings.state_file, tenants=settings.front_tenants())
    except ValueError as e:  # a state file it cannot read: said, never replaced
        raise ConfigError("tinker.state_file", str(e)) from None
    try:
        app = create_app(service)
    except ValueError as e:  # a request journal it cannot read: said, never replaced
        raise ConfigError("tinker.state_file", str(e)) from None
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
