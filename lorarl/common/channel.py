"""Client channels to lorarl services: bearer token, optional TLS / mutual TLS, sane limits.

The token travels as `authorization: Bearer <token>` metadata added by a client interceptor,
which (unlike call credentials) also works on plaintext loopback channels.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from lorarl.common.auth import AUTHORIZATION_KEY
from lorarl.common.server_config import CLIENT_KEEPALIVE_S, PeerTlsConfig

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: Overrides every lorarl client's keepalive interval (seconds), e.g. below a load balancer's idle timeout.
KEEPALIVE_ENV = "LORARL_GRPC_KEEPALIVE_S"

ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class ClientTls:
    """Client side of TLS: the CA to trust, and a certificate of our own for mutual TLS."""

    ca_file: str | None = None  # None: the system's trusted roots
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # expected name in the server certificate, if not the target host

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("ClientTls: cert_file and key_file must be set together")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )


def peer_tls(config: PeerTlsConfig) -> ClientTls | None:
    """A service's TLS towards its peers (``server.peer_tls``); None: plaintext."""
    if config.ca_file is None:
        return None
    return ClientTls(ca_file=config.ca_file, cert_file=config.cert_file, key_file=config.key_file,
                     server_name=config.server_name)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


def client_keepalive_s(env: Mapping[str, str] | None = None) -> float:
    """How often a client pings a quiet connection: $LORARL_GRPC_KEEPALIVE_S, else CLIENT_KEEPALIVE_S.

    Pings keep NATs and load balancers from dropping calls that carry no data for minutes (a long
    TrainStep, an idle Subscribe); servers must accept them (``server.min_client_ping_interval_s``).
    gRPC sends at most one ping a second whatever is asked.
    """
    raw = (os.environ if env is None else env).get(KEEPALIVE_ENV)
    if raw is None or not raw.strip():
        return CLIENT_KEEPALIVE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1.0):
        raise ValueError(f"${KEEPALIVE_ENV} must be a number of seconds >= 1 (gRPC's floor), got {raw!r}")
    return value


def channel_options(
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    keepalive_time_s: float | None = None,
    keepalive_timeout_s: float = 20.0,
    server_name: str | None = None,
) -> list[tuple[str, Any]]:
    """Channel arguments matching what lorarl servers accept (message size, keepalive pings).

    ``keepalive_time_s`` None: `client_keepalive_s()`.
    """
    if keepalive_time_s is None:
        keepalive_time_s = client_keepalive_s()
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def aio_channel(
    target: str,
    *,
    token: str | None = None,
    tls: ClientTls | None = None,
    options: ChannelOptions | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `target` ('host:port'); use as `async with aio_channel(...) as ch`."""
    opts = list(options) if options is not None else channel_options(server_name=tls and tls.server_name)
    interceptors = aio_token_interceptors(token) if token else None
    if tls is None:
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
    return grpc.aio.secure_channel(target, tls.credentials(), options=opts, interceptors=interceptors)


def sync_channel(
    target: str,
    *,
    token: str | None = None,
    tls: ClientTls | None = None,
    options: ChannelOptions | None = None,
) -> grpc.Channel:
    """A blocking grpc channel to `target`, for scripts and tests."""
    opts = list(options) if options is not None else channel_options(server_name=tls and tls.server_name)
    if tls is None:
        channel = grpc.insecure_channel(target, options=opts)
    else:
        channel = grpc.secure_channel(target, tls.credentials(), options=opts)
    return grpc.intercept_channel(channel, SyncBearerToken(token)) if token else channel


def _with_token(metadata: Any, token: str) -> list[tuple[str, Any]]:
    entries = [(k, v) for k, v in (metadata or ()) if k.lower() != AUTHORIZATION_KEY]
    entries.append((AUTHORIZATION_KEY, f"Bearer {token}"))
    return entries


class _AioBearerToken:
    """Adds the bearer token to the details of a grpc.aio call."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout,
            metadata=grpc.aio.Metadata(*_with_token(details.metadata, self._token)),
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )


class _AioUnaryUnaryToken(_AioBearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStreamToken(_AioBearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnaryToken(_AioBearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStreamToken(_AioBearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call arity: a grpc.aio channel files each interceptor under one arity only."""
    return [
        _AioUnaryUnaryToken(token),
        _AioUnaryStreamToken(token),
        _AioStreamUnaryToken(token),
        _AioStreamStreamToken(token),
    ]


class _SyncCallDetails(
    collections.namedtuple(
        "_SyncCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    """grpc.ClientCallDetails with fields, built as in grpc's own interceptor examples."""


class SyncBearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token to every call of a blocking grpc channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: Any) -> grpc.ClientCallDetails:
        return _SyncCallDetails(
            details.method,
            details.timeout,
            _with_token(details.metadata, self._token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
