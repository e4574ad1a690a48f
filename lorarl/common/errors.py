"""Plain exceptions that mean a gRPC status, and their translation at the servicer boundary.

Delegate classes (trainer, rollout, weight sync logic) raise these without knowing about gRPC;
the server bootstrap installs `ErrorInterceptor`, so every RPC turns them into
`context.abort(code, message)`. Anything else a handler raises becomes INTERNAL, logged with
its traceback. `translate_errors` does the same for a single servicer method when a servicer
runs outside the bootstrap.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import grpc

from lorarl.common.handlers import parsing_in_call, wrap_method_handler

logger = logging.getLogger(__name__)

#: Trailing metadata key naming the offending request field of an INVALID_ARGUMENT error.
FIELD_METADATA_KEY = "lorarl-field"

F = TypeVar("F", bound=Callable[..., Any])


class ServiceError(Exception):
    """An error with a gRPC status code; `field` names the offending request field, if any."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def status_message(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class InvalidArgumentError(ServiceError):
    """The request is malformed whatever the server's state; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message, field=field)


class NotFoundError(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(ServiceError):
    """The request is valid but the server is not in a state to run it (e.g. no job loaded)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRangeError(ServiceError):
    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhaustedError(ServiceError):
    """A limit was hit (memory, buffer size, quota); retrying later may succeed."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class AbortedError(ServiceError):
    """A concurrency conflict, e.g. a version superseded mid-operation; retry the sequence."""

    code = grpc.StatusCode.ABORTED


class UnavailableError(ServiceError):
    """Transient: a dependency is down or the server is shutting down; safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnimplementedError(ServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


class DeadlineExceededError(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InternalError(ServiceError):
    code = grpc.StatusCode.INTERNAL


def status_for(exc: BaseException, method: str = "") -> tuple[grpc.StatusCode, str]:
    """The status code and message an exception raised by a handler should produce."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.status_message()
    if isinstance(exc, NotImplementedError):
        what = method or "this method"
        return grpc.StatusCode.UNIMPLEMENTED, f"{what} is not implemented yet"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out: {exc}" if str(exc) else "timed out"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}): {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str = "") -> None:
    """Ends the call with the status for `exc` (raises grpc.aio.AbortError, like context.abort)."""
    code, message = status_for(exc, method)
    metadata: tuple[tuple[str, str], ...] = ()
    if isinstance(exc, ServiceError) and exc.field:
        metadata = ((FIELD_METADATA_KEY, exc.field),)
    await context.abort(code, message, metadata)


@asynccontextmanager
async def translating_errors(context: grpc.aio.ServicerContext, method: str = "") -> AsyncIterator[None]:
    """Runs a handler body; exceptions it raises become the matching gRPC status."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # the handler already set the status
    except Exception as exc:
        if not isinstance(exc, ServiceError | NotImplementedError):
            logger.exception("unexpected error in %s", method or "handler", extra={"method": method})
        await abort_with(context, exc, method)


def translate_errors(method: F) -> F:
    """Decorates an async servicer method (coroutine or async generator) like ErrorInterceptor."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with translating_errors(context, name):
                async for response in method(self, request, context):
                    yield response

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def call(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with translating_errors(context, name):
            result = method(self, request, context)
            return await result if inspect.isawaitable(result) else result

    return call  # type: ignore[return-value]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Translates exceptions raised by any handler into gRPC statuses (see module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def around(context: grpc.aio.ServicerContext) -> AbstractAsyncContextManager[None]:
            return translating_errors(context, method)

        return wrap_method_handler(parsing_in_call(handler, unparsable_body), around)


def unparsable_body(type_name: str, exc: Exception) -> InvalidArgumentError:
    """A request body that is not the message it should be; the parser's words, cut short."""
    return InvalidArgumentError("request", f"the request body is not a valid {type_name}: {str(exc)[:200]}")
