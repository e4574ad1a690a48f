"""Which failures a run waits out, and for how long: the recovery rule and its budget in one place.

A service that restarts shows up as UNAVAILABLE (connection refused or reset), DEADLINE_EXCEEDED,
ABORTED or CANCELLED; a restarted trainer as NOT_FOUND for the job it no longer holds; a rollout that
died while staging a version as a failed activation. Those the loop survives: it waits for every
service to answer its health check, restores the job from its last resume point and carries on.
Anything else (a bad config, a refused token, a bug) ends the run at once with the service's message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorarl.client.calls import ServiceCallError

#: Codes that a restart or a dropped connection produces, not the request itself.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.CANCELLED})
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 30.0
HEALTH_POLL_S = 0.5


class ActivationFailedError(RuntimeError):
    """A published version did not go live (a replica dropped out while staging it)."""


class RecoveryExhaustedError(RuntimeError):
    """The run met more faults than ``recovery.max_recoveries``, or a service did not come back."""


def recoverable(error: BaseException) -> bool:
    """Whether the loop should wait ``error`` out and restore the job (the module docstring's rule)."""
    if isinstance(error, ActivationFailedError):
        return True
    if isinstance(error, ServiceCallError):
        return error.code in TRANSIENT or (error.code == grpc.StatusCode.NOT_FOUND and error.service == "trainer")
    return False


@dataclass
class RecoveryBudget:
    """At most ``max_recoveries`` faults in a row, each waited out with a growing pause. A run that then completes
    ``healthy_steps`` steps without a fault starts again from zero (count and pause): a job that meets a service
    restart every hour for days keeps going, one that keeps failing still stops."""

    max_recoveries: int
    wait_s: float
    used: int = 0
    healthy_steps: int = 0  # 0: the count is for the whole run
    recovered_at: int | None = None  # the step the last recovery carried on from

    def recovered(self, step: int) -> None:
        self.recovered_at = step

    def progress(self, step: int) -> bool:
        """A step completed; True when it makes the run healthy again (the budget starts over)."""
        if not (self.used and self.healthy_steps and self.recovered_at is not None
                and step - self.recovered_at >= self.healthy_steps):
            return False
        self.used, self.recovered_at = 0, None
        return True

    def spend(self, error: BaseException) -> float:
        """Counts one fault; the seconds to pause before restoring. Raises once the budget is spent."""
        if self.used >= self.max_recoveries:
            raise RecoveryExhaustedError(f"gave up after {self.used} recoveries (recovery.max_recoveries): {error}") \
                from error
        self.used += 1
        return min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** (self.used - 1))


async def wait_serving(channels: Mapping[str, grpc.aio.Channel], timeout_s: float,
                       give_up: Callable[[], None] | None = None) -> None:
    """Returns once every named channel's server answers SERVING; RecoveryExhaustedError after ``timeout_s``.
    ``give_up()`` may raise to stop waiting early (a supervisor that will not restart a service again)."""
    deadline = time.monotonic() + timeout_s
    for name, channel in channels.items():
        stub = health_pb2_grpc.HealthStub(channel)
        last = "no answer"
        while True:
            if give_up is not None:
                give_up()
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() > deadline:
                raise RecoveryExhaustedError(f"{name} did not come back within {timeout_s:.0f} s (recovery.wait_s); "
                                        f"last answer: {last}")
            await asyncio.sleep(HEALTH_POLL_S)
