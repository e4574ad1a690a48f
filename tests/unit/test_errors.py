"""Exceptions raised by delegate classes become the right gRPC status, code and message."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from lorarl.common import errors
from lorarl.common.errors import (
    FIELD_METADATA_KEY,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    ServiceError,
    status_for,
    translate_errors,
)


class FakeContext:
    """Records context.abort() like grpc.aio does: status set, then AbortError raised."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str, Any] | None = None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.aborted = (code, details, trailing_metadata)
        raise grpc.aio.AbortError("aborted")


SUBCLASSES = [
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.OutOfRangeError, grpc.StatusCode.OUT_OF_RANGE),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.AbortedError, grpc.StatusCode.ABORTED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.UnimplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.InternalError, grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("error_type", "code"), SUBCLASSES)
def test_each_error_maps_to_its_code(error_type: type[ServiceError], code: grpc.StatusCode) -> None:
    assert status_for(error_type("job 'a' is busy")) == (code, "job 'a' is busy")


def test_invalid_argument_names_the_field() -> None:
    exc = InvalidArgumentError("trajectories[3].reward", "must be finite, got nan")
    assert exc.field == "trajectories[3].reward"
    assert status_for(exc) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "trajectories[3].reward: must be finite, got nan",
    )


def test_plain_exceptions() -> None:
    assert status_for(NotImplementedError(), "/x.S/M") == (
        grpc.StatusCode.UNIMPLEMENTED,
        "/x.S/M is not implemented yet",
    )
    assert status_for(TimeoutError("waiting for replicas"))[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    code, message = status_for(KeyError("job"))
    assert code == grpc.StatusCode.INTERNAL
    assert "KeyError" in message


def test_decorated_coroutine_aborts_with_field_metadata() -> None:
    class Servicer:
        @translate_errors
        async def CreateJob(self, request: Any, context: Any) -> str:  # noqa: N802 - gRPC method name
            raise InvalidArgumentError("job_id", "must not be empty")

    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(Servicer().CreateJob(None, context))
    assert context.aborted == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "job_id: must not be empty",
        ((FIELD_METADATA_KEY, "job_id"),),
    )


def test_decorated_coroutine_passes_results_through() -> None:
    class Servicer:
        @translate_errors
        async def GetJob(self, request: Any, context: Any) -> str:  # noqa: N802
            return f"job {request}"

    context = FakeContext()
    assert asyncio.run(Servicer().GetJob("a", context)) == "job a"
    assert context.aborted is None


def test_decorated_stream_keeps_items_sent_before_the_error() -> None:
    class Servicer:
        @translate_errors
        async def Fetch(self, request: Any, context: Any):  # noqa: N802
            yield 1
            yield 2
            raise ResourceExhaustedError("buffer full")

    async def consume(context: FakeContext) -> list[int]:
        received = []
        with pytest.raises(grpc.aio.AbortError):
            async for item in Servicer().Fetch(None, context):
                received.append(item)
        return received

    context = FakeContext()
    assert asyncio.run(consume(context)) == [1, 2]
    assert context.aborted is not None
    assert context.aborted[:2] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "buffer full")


def test_unexpected_errors_are_logged_and_internal(caplog: pytest.LogCaptureFixture) -> None:
    class Servicer:
        @translate_errors
        async def Step(self, request: Any, context: Any) -> None:  # noqa: N802
            raise ZeroDivisionError("division by zero")

    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(Servicer().Step(None, context))
    assert context.aborted is not None
    assert context.aborted[0] == grpc.StatusCode.INTERNAL
    assert "ZeroDivisionError" in context.aborted[1]
    assert any(record.exc_info for record in caplog.records)


def test_abort_already_called_is_left_alone() -> None:
    class Servicer:
        @translate_errors
        async def Get(self, request: Any, context: Any) -> None:  # noqa: N802
            await context.abort(grpc.StatusCode.NOT_FOUND, "own message")

    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(Servicer().Get(None, context))
    assert context.aborted is not None
    assert context.aborted[:2] == (grpc.StatusCode.NOT_FOUND, "own message")


def test_expected_errors_are_not_logged_as_failures(caplog: pytest.LogCaptureFixture) -> None:
    class Servicer:
        @translate_errors
        async def Get(self, request: Any, context: Any) -> None:  # noqa: N802
            raise NotFoundError("no job 'x'")

    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(Servicer().Get(None, FakeContext()))
    assert not [r for r in caplog.records if r.exc_info]


def test_cancellation_is_not_translated() -> None:
    class Servicer:
        @translate_errors
        async def Wait(self, request: Any, context: Any) -> None:  # noqa: N802
            raise asyncio.CancelledError

    context = FakeContext()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(Servicer().Wait(None, context))
    assert context.aborted is None


def test_failed_precondition_without_field() -> None:
    exc = FailedPreconditionError("job 'a' has no buffered trajectories")
    assert exc.field is None
    assert status_for(exc)[1] == "job 'a' has no buffered trajectories"
