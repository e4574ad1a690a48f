"""Bearer-token authentication: where tokens come from, and the server-side check on every RPC.

Clients send `authorization: Bearer <token>` metadata (see lorarl.common.channel). The server
compares it in constant time with its own token and answers UNAUTHENTICATED otherwise, except
for health checks, which load balancers and supervisors must reach without credentials.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from lorarl.common.config import ConfigError
from lorarl.common.handlers import handler_kind, rpc_method_handler
from lorarl.common.server_config import DEFAULT_TOKEN_ENV, AuthConfig

logger = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"
BEARER_SCHEME = "bearer"
#: Methods reachable without a token: standard health checking.
DEFAULT_EXEMPT_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)


def resolve_token(
    *,
    token: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    token_env: str | None = DEFAULT_TOKEN_ENV,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """The first token found in: `token`, the content of `token_file`, then `$token_env`.

    Raises ConfigError (key 'token_file') when the file cannot be read or is empty.
    """
    if token:
        return token.strip()
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError("token_file", f"cannot read {str(token_file)!r}: {exc.strerror}") from None
        if not text:
            raise ConfigError("token_file", f"{str(token_file)!r} is empty")
        return text
    if token_env:
        value = (os.environ if env is None else env).get(token_env, "").strip()
        return value or None
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name a server binds) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_token(auth: AuthConfig, env: Mapping[str, str] | None = None, *, host: str) -> str | None:
    """The token a server checks. Fails closed: without a token the server does not start, unless
    ``auth.required`` is false and it binds a loopback ``host`` (then None: no authentication)."""
    try:
        token = resolve_token(token=auth.token, token_file=auth.token_file, token_env=auth.token_env, env=env)
    except ConfigError as exc:
        raise exc.under("server.auth") from None
    if token is not None:
        return token
    sources = ["server.auth.token", "server.auth.token_file"]
    if auth.token_env:
        sources.append(f"${auth.token_env}")
    if auth.required:
        raise ConfigError("server.auth.required", f"no token was found in {', '.join(sources)}; set one "
                                                  "(or server.auth.required: false on a loopback host, for a test)")
    if not is_loopback(host):
        raise ConfigError("server.auth.required", f"false is allowed on a loopback host only, and server.host is "
                                                  f"{host!r}: give the service a token ({', '.join(sources)})")
    return None


def bearer_metadata(token: str) -> tuple[tuple[str, str]]:
    """The metadata entry that carries `token`."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),)


def tokens_match(presented: str, expected: str) -> bool:
    """Constant-time comparison, so response timing does not reveal how much of a guess was right."""
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def presented_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The bearer token a call presents (None: no well-formed 'authorization: Bearer <token>')."""
    values = [v for k, v in (metadata or ()) if k.lower() == AUTHORIZATION_KEY]
    if not values:
        return None
    value = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else str(values[0])
    scheme, _, presented = value.strip().partition(" ")
    return presented.strip() if scheme.lower() == BEARER_SCHEME and presented.strip() else None


class BearerTokenCheck:
    """Decides whether call metadata carries the expected token (or one of ``also``: keys a service scopes
    itself, such as a trainer's per-job keys); no gRPC machinery, easy to test."""

    def __init__(self, token: str, *, token_hint: str = f"${DEFAULT_TOKEN_ENV}", also: Sequence[str] = ()) -> None:
        if not token or not all(also):
            raise ValueError("BearerTokenCheck needs non-empty tokens")
        self._tokens = (token, *also)
        self._hint = token_hint

    def problem(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """None when authenticated, else a message a person can act on (never echoing tokens)."""
        values = [v for k, v in (metadata or ()) if k.lower() == AUTHORIZATION_KEY]
        if not values:
            return (
                "missing credentials: send metadata 'authorization: Bearer <token>' "
                f"with the server's token (clients read it from {self._hint})"
            )
        value = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else str(values[0])
        scheme, _, presented = value.strip().partition(" ")
        if scheme.lower() != BEARER_SCHEME or not presented.strip():
            return "malformed authorization metadata: expected 'Bearer <token>'"
        # every token compared, so timing does not tell which (if any) matched
        if not [t for t in self._tokens if tokens_match(presented.strip(), t)]:
            return f"invalid bearer token: it does not match the server's token (check {self._hint})"
        return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the right bearer token with UNAUTHENTICATED, before any handler runs."""

    def __init__(
        self,
        token: str,
        *,
        exempt_prefixes: Sequence[str] = DEFAULT_EXEMPT_PREFIXES,
        token_hint: str = f"${DEFAULT_TOKEN_ENV}",
        also: Sequence[str] = (),
    ) -> None:
        self._check = BearerTokenCheck(token, token_hint=token_hint, also=also)
        self._exempt = tuple(exempt_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(self._exempt):
            return await continuation(handler_call_details)
        problem = self._check.problem(handler_call_details.invocation_metadata)
        if problem is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _rejection(method, problem, handler)


def _rejection(method: str, problem: str, like: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same arity as `like` that answers UNAUTHENTICATED without parsing the body: an
    unauthenticated caller learns nothing of the message types from parse errors."""
    kind = handler_kind(like) if like is not None else "unary_unary"

    async def reject(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        logger.warning("rejected unauthenticated call", extra={"method": method, "peer": context.peer()})
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    return rpc_method_handler(kind, reject, like, parse=False)
