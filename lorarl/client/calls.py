"""Service stubs whose failures say which service, which call and what to do, in one line.

A raw grpc error names neither the service nor the call ("UNAVAILABLE: Connection reset by peer").
``NamedStub`` wraps a generated stub: every call that fails raises ``ServiceCallError``, which keeps
the status code (the recovery rule reads it) and prints as
``trainer at 127.0.0.1:5001: TrainStep failed with UNAVAILABLE (...); <hint>``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from lorarl.common.auth import resolve_token
from lorarl.common.server_config import DEFAULT_TOKEN_ENV
from lorarl.common.validation import quote

if TYPE_CHECKING:
    from lorarl.client.rl.stall import CallTracker

#: The client's token file when --token-file is not given (a compose secret, a mounted file).
TOKEN_FILE_ENV = "LORARL_AUTH_TOKEN_FILE"

#: What a person can do about each code, after the call failed with it.
HINTS = {
    grpc.StatusCode.UNAVAILABLE: "is the service running and reachable? (it may be restarting)",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the service did not answer in time (loop.call_timeout_s); check its log "
                                       "for a stuck step",
    grpc.StatusCode.UNAUTHENTICATED: "the token differs from the services' (pass theirs with --token-file)",
    grpc.StatusCode.PERMISSION_DENIED: "the token differs from the services' (pass theirs with --token-file)",
    grpc.StatusCode.INVALID_ARGUMENT: "fix the job config field the message names",
    grpc.StatusCode.FAILED_PRECONDITION: "the service's state does not allow this call; see the message",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the service is out of room (memory, jobs or buffer); see the message",
    grpc.StatusCode.ALREADY_EXISTS: "what the call creates exists already (a job: delete it or pick another "
                                    "job_id; a request: another with its id is in flight)",
    grpc.StatusCode.NOT_FOUND: "the service does not hold what the call names (was it restarted?)",
    grpc.StatusCode.INTERNAL: "a bug in the service: its log has the traceback",
    grpc.StatusCode.UNKNOWN: "a bug in the service: its log has the traceback",
}


def client_token(token_file: str | None = None) -> str | None:
    """The token a client sends: ``token_file`` (--token-file), else $LORARL_AUTH_TOKEN_FILE, else
    $LORARL_AUTH_TOKEN. A file keeps it out of the environment, which ``ps e`` and ``docker inspect`` show."""
    return resolve_token(token_file=token_file or os.environ.get(TOKEN_FILE_ENV) or None, token_env=DEFAULT_TOKEN_ENV)


class ServiceCallError(Exception):
    """A call to one service failed; ``code`` is the grpc status code."""

    def __init__(self, service: str, address: str, method: str, code: grpc.StatusCode, details: str) -> None:
        self.service, self.address, self.method, self.code, self.details = service, address, method, code, details
        hint = HINTS.get(code, "see the service's log")
        where = f"{service} at {address}" if address else service
        super().__init__(f"{where}: {method} failed with {code.name} ({quote(details or 'no details')}); {hint}")


class NamedStub:
    """A generated stub whose calls raise ServiceCallError instead of a bare grpc error. ``deadline_s``: the gRPC
    deadline of every call that names none itself, so a service that hangs (alive, answering health checks,
    never this call) ends the call with DEADLINE_EXCEEDED naming service and method instead of holding the
    caller forever."""

    def __init__(self, stub: Any, service: str, address: str = "", deadline_s: float | None = None,
                 tracker: CallTracker | None = None) -> None:
        self._stub, self.service, self.address, self.deadline_s = stub, service, address, deadline_s
        self.tracker = tracker  # the stall watchdog's record of calls in flight (lorarl.client.rl.stall)

    def _error(self, method: str, error: grpc.aio.AioRpcError) -> ServiceCallError:
        return ServiceCallError(self.service, self.address, method, error.code(), error.details() or "")

    def __getattr__(self, method: str) -> Callable[..., Any]:
        call = getattr(self._stub, method)
        deadline = {"timeout": self.deadline_s} if self.deadline_s else {}
        if isinstance(call, grpc.aio.UnaryStreamMultiCallable | grpc.aio.StreamStreamMultiCallable):
            def streaming(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                kwargs = {**deadline, **kwargs}

                async def responses() -> AsyncIterator[Any]:
                    with self._tracked(method):
                        try:
                            async for response in call(*args, **kwargs):
                                if self.tracker is not None:
                                    self.tracker.progress()  # a stream that delivers is moving
                                yield response
                        except grpc.aio.AioRpcError as e:
                            raise self._error(method, e) from None
                return responses()
            return streaming

        async def unary(*args: Any, **kwargs: Any) -> Any:
            with self._tracked(method):
                try:
                    return await call(*args, **{**deadline, **kwargs})
                except grpc.aio.AioRpcError as e:
                    raise self._error(method, e) from None
        return unary

    def _tracked(self, method: str) -> contextlib.AbstractContextManager[None]:
        if self.tracker is None:
            return contextlib.nullcontext()
        return self.tracker.call(self.service, self.address, method)
