"""The stall watchdog (lorarl.client.rl.stall): a run where nothing moves for loop.stall.after_s names the calls it
waits on, service, address, method and age, and warns once per stall or ends the run; calls that keep ending
are progress. A real grpc.aio server on loopback whose one method sleeps."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import grpc
import pytest

from lorarl.client.calls import NamedStub
from lorarl.client.job.config import StallSection, load_job_config
from lorarl.client.rl.stall import CallTracker, StallError, run_watched
from tests.unit.clients.test_call_deadlines import Stub, serve


async def calls(sleep_s: float, body) -> object:
    server, port = await serve(sleep_s=sleep_s)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            tracker = CallTracker()
            return await body(NamedStub(Stub(channel), "trainer", f"127.0.0.1:{port}", tracker=tracker), tracker)
    finally:
        await server.stop(0)


def test_a_stuck_call_is_named_and_fail_ends_the_run() -> None:
    async def body(stub: NamedStub, tracker: CallTracker) -> tuple[str, float]:
        started = time.monotonic()
        with pytest.raises(StallError) as err:
            await run_watched(stub.Call(b"x"), tracker, StallSection(after_s=0.4, action="fail"))
        assert not tracker.in_flight()  # the stuck call was cancelled with the run
        return str(err.value), time.monotonic() - started

    message, elapsed = asyncio.run(calls(30.0, body))
    assert elapsed < 10.0  # the call itself sleeps 30 s
    assert re.fullmatch(r"no progress for \d+ s; waiting on trainer at 127\.0\.0\.1:\d+: Call, in flight \d+ s "
                        r"\(loop\.stall\.after_s = 0\.4\)", message), message


def test_warn_logs_once_per_stall_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def body(stub: NamedStub, tracker: CallTracker) -> bytes:
        return await run_watched(stub.Call(b"y"), tracker, StallSection(after_s=0.3, action="warn"))

    with caplog.at_level(logging.WARNING, logger="lorarl.client.rl.stall"):
        asyncio.run(calls(1.5, body))
    # the stall logger's own records: caplog also holds whatever else warned meanwhile (ci23: a tinker SDK client
    # left by an earlier test in the same worker, warning that its front was gone)
    warnings = [r.getMessage() for r in caplog.records if r.name == "lorarl.client.rl.stall"]
    assert len(warnings) == 1 and ": Call, in flight" in warnings[0]


def test_calls_that_keep_ending_are_progress() -> None:
    async def body(stub: NamedStub, tracker: CallTracker) -> None:
        async def work() -> None:
            for _ in range(10):
                await stub.Call(b"z")  # 0.3 s each: 3 s in all, never 1.5 s without one ending
        await run_watched(work(), tracker, StallSection(after_s=1.5, action="fail"))

    asyncio.run(calls(0.3, body))


def test_with_no_call_in_flight_it_says_the_loop_is_on_its_own_work() -> None:
    with pytest.raises(StallError, match="no call to a service in flight"):
        asyncio.run(run_watched(asyncio.sleep(5.0), CallTracker(), StallSection(after_s=0.3, action="fail")))
    asyncio.run(run_watched(asyncio.sleep(0.5), CallTracker(), StallSection(after_s=0, action="fail")))  # 0: off


def test_the_job_file_sets_it() -> None:
    cfg = load_job_config(None, ["loop.stall.after_s=120", "loop.stall.action=fail"])
    assert (cfg.loop.stall.after_s, cfg.loop.stall.action) == (120.0, "fail")
    assert load_job_config(None, []).loop.stall == StallSection(after_s=600.0, action="warn")
