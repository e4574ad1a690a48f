"""Every call the loop makes has a deadline (loop.call_timeout_s, NamedStub's deadline_s): a service that is alive
but never answers one call ends it with DEADLINE_EXCEEDED naming the service and the call, which the recovery rule
waits out (re-issuing it after a restore) or fails with; it never holds the loop forever. A real grpc.aio server
on loopback, whose one method sleeps."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from lorarl.client.calls import NamedStub, ServiceCallError
from lorarl.client.rl.recovery import recoverable

METHOD = "/lorarl.test.Stuck/Call"


async def serve(sleep_s: float) -> tuple[grpc.aio.Server, int]:
    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(sleep_s)
        return request

    handler = grpc.method_handlers_generic_handler(
        "lorarl.test.Stuck", {"Call": grpc.unary_unary_rpc_method_handler(call)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


class Stub:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.Call = channel.unary_unary(METHOD)


def test_a_call_past_its_deadline_names_its_service_and_method_and_is_recovered_from() -> None:
    async def body() -> tuple[ServiceCallError, float]:
        server, port = await serve(sleep_s=5.0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = NamedStub(Stub(channel), "trainer", f"127.0.0.1:{port}", deadline_s=0.3)
                started = time.monotonic()
                with pytest.raises(ServiceCallError) as err:
                    await stub.Call(b"x")
                return err.value, time.monotonic() - started
        finally:
            await server.stop(0)

    error, elapsed = asyncio.run(body())
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and elapsed < 3.0
    assert "trainer at 127.0.0.1:" in str(error) and "Call failed with DEADLINE_EXCEEDED" in str(error)
    assert "loop.call_timeout_s" in str(error)
    assert recoverable(error)


def test_a_callers_own_timeout_wins_over_the_default_deadline() -> None:
    async def body() -> bytes:
        server, port = await serve(sleep_s=0.3)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await NamedStub(Stub(channel), "rollout", deadline_s=0.05).Call(b"y", timeout=10)
        finally:
            await server.stop(0)

    assert asyncio.run(body()) == b"y"
