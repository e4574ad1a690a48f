"""The `server:` section every service config shares: network, security, limits, observability."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lorarl.common.config import ConfigError, existing_file, in_range, port_number, setting
from lorarl.common.cpu_affinity import check_cpu_setting, cpu_list

DEFAULT_TOKEN_ENV = "LORARL_AUTH_TOKEN"
MIB = 1024 * 1024
#: How often lorarl's client channels ping an idle connection (lorarl.common.channel.channel_options).
CLIENT_KEEPALIVE_S = 30.0
#: The servers accept pings three times as often as lorarl clients send them: timer jitter never strikes.
MIN_CLIENT_PING_INTERVAL_S = CLIENT_KEEPALIVE_S / 3

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["json", "text"]


@dataclass
class AuthConfig:
    """Where the server's bearer token comes from; first found wins: token, token_file, token_env."""

    token: str | None = setting(None, doc="The token itself (prefer token_file or token_env).")
    token_file: str | None = setting(None, check=existing_file, doc="File whose stripped content is the token.")
    token_env: str | None = setting(DEFAULT_TOKEN_ENV, doc="Environment variable holding the token.")
    required: bool = setting(True, doc="Refuse to start without a token; false runs without authentication, "
                                       "on a loopback host only.")

    def validate(self) -> None:
        if self.token is not None and not self.token.strip():
            raise ConfigError("token", "must not be empty (omit it to use token_file or token_env)")


@dataclass
class TlsConfig:
    """Server certificate, and the CA that client certificates must chain to for mutual TLS."""

    cert_file: str | None = setting(None, check=existing_file, doc="PEM certificate chain.")
    key_file: str | None = setting(None, check=existing_file, doc="PEM private key.")
    client_ca_file: str | None = setting(
        None, check=existing_file, doc="PEM CA bundle; when set, clients must present a certificate."
    )

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    def validate(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.key_file is None else "cert_file"
            raise ConfigError(missing, "cert_file and key_file must be set together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ConfigError("client_ca_file", "mutual TLS needs cert_file and key_file too")


@dataclass
class PeerTlsConfig:
    """How this service's own calls to its peers are secured (the trainer and each rollout call weight
    sync): TLS once ``ca_file`` is set, mutual TLS with a certificate of our own (channel.peer_tls)."""

    ca_file: str | None = setting(None, check=existing_file, doc="PEM CA bundle the peer's server certificate "
                                  "must chain to; set: calls to peers use TLS.")
    cert_file: str | None = setting(None, check=existing_file, doc="PEM client certificate, for peers that "
                                    "require mutual TLS.")
    key_file: str | None = setting(None, check=existing_file, doc="PEM private key of cert_file.")
    server_name: str | None = setting(None, doc="Name expected in the peer's certificate, if not its host.")

    def validate(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("key_file" if self.key_file is None else "cert_file",
                              "cert_file and key_file must be set together")
        if self.cert_file is not None and self.ca_file is None:
            raise ConfigError("ca_file", "a client certificate needs TLS: set ca_file too")


@dataclass
class ServerConfig:
    """How a service listens and reports; shared by trainer, rollout and weight sync."""

    host: str = setting("127.0.0.1", doc="Address to bind; 0.0.0.0 or :: for every interface.")
    port: int = setting(0, check=port_number(), doc="gRPC port; 0 picks a free one (see ready_file).")
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    peer_tls: PeerTlsConfig = field(default_factory=PeerTlsConfig)
    max_message_bytes: int = setting(
        256 * MIB, check=in_range(1024, 2**31 - 1), doc="Largest message sent or received."
    )
    max_concurrent_rpcs: int | None = setting(None, check=in_range(1), doc="Beyond this, RPCs are refused.")
    keepalive_time_s: float = setting(60.0, check=in_range(1.0), doc="Ping idle clients this often.")
    keepalive_timeout_s: float = setting(20.0, check=in_range(0.1), doc="Drop clients not answering a ping.")
    min_client_ping_interval_s: float = setting(
        MIN_CLIENT_PING_INTERVAL_S, check=in_range(0.01),
        doc="Accept clients' keepalive pings this often on a connection with no data. Pings sooner than "
        "this count as strikes and the second strike closes the connection (GOAWAY too_many_pings), so it "
        f"must stay below the clients' keepalive interval (lorarl clients ping every {CLIENT_KEEPALIVE_S:g} s)."
    )
    shutdown_grace_s: float = setting(10.0, check=in_range(0.0), doc="Bound on draining in-flight RPCs.")
    metrics_port: int | None = setting(
        None,
        check=port_number(allow_disabled=True),
        doc="Prometheus HTTP port; 0 picks a free one; -1 or null disables.",
    )
    metrics_host: str = setting(
        "127.0.0.1", doc="Address the metrics endpoint binds. It has no authentication: loopback unless a "
        "scraper on another machine needs it (then e.g. 0.0.0.0 behind a network you trust)."
    )
    cpu_nice: int = setting(
        0, check=in_range(0, 19), doc="Niceness added to the whole process at start, gRPC threads included "
        "(0: none). For a trainer sharing CPUs with generation prefer trainer.compute_nice (`lorarl run` "
        "uses that): it lowers only the threads that compute."
    )
    cpus: str = setting(
        "", check=cpu_list, doc="CPUs the whole process runs on, every thread, as a Linux CPU list ('1', "
        "'0-3,8'); empty: wherever the OS puts it. `lorarl run` pins a CPU job's trainer (placement.pin_cpus)."
    )
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"
    ready_file: str | None = setting(
        None, doc="Once serving, JSON {service, pid, port, metrics_port, address} is written here."
    )

    @property
    def metrics_enabled(self) -> bool:
        return self.metrics_port is not None and self.metrics_port >= 0

    def validate(self) -> None:
        if not self.host:
            raise ConfigError("host", "must not be empty")
        if self.cpus:
            check_cpu_setting("cpus", self.cpus)
        if self.metrics_enabled and self.metrics_port and self.metrics_port == self.port:
            raise ConfigError("metrics_port", f"must differ from port ({self.port})")
