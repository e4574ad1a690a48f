"""Waiting for a version's activation outcome, for any client of WeightSyncService (the trainer's
publisher, the orchestration loop): one place that slices the wait and rides out a service restart."""

from __future__ import annotations

import asyncio
import time

import grpc

from lorarl.v1 import weightsync_pb2

PENDING = weightsync_pb2.ACTIVATION_OUTCOME_PENDING
#: Longest single AwaitActivation wait asked of the service; the client loops until its own deadline.
AWAIT_SLICE_S = 30.0


async def await_outcome(stub, job_id: str, version: int, timeout_s: float = 600.0
                        ) -> weightsync_pb2.AwaitActivationResponse:
    """The version's two-phase outcome (PENDING if `timeout_s` runs out first); UNAVAILABLE (weight sync
    restarting) is retried until then, any other RPC error raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.0, deadline - time.monotonic())
        request = weightsync_pb2.AwaitActivationRequest(job_id=job_id, version=version,
                                                        timeout_seconds=min(left, AWAIT_SLICE_S))
        try:
            response = await stub.AwaitActivation(request, timeout=AWAIT_SLICE_S + 30)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or left <= 0:
                raise
            await asyncio.sleep(min(0.5, left))
            continue
        if response.outcome != PENDING or left <= 0:
            return response
