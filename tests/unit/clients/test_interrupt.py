"""A launcher's event loop stopped by SIGTERM or Ctrl-C (lorarl.client.interrupt): the main task is cancelled,
its child tasks unwind, KeyboardInterrupt comes out of ``run_interruptible``, and nothing prints a traceback —
even when the signal lands in a child task's own code, where raising KeyboardInterrupt (what launchers did)
left asyncio logging the task's exception with its traceback, and a launcher that exited 1."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lorarl.client.interrupt import run_interruptible

# Two child tasks that spend nearly all their time in their own code, so the signal lands there.
SCRIPT = textwrap.dedent("""
    import asyncio, signal, sys, time
    from lorarl.client.interrupt import run_interruptible, stop_on_sigterm

    # a launcher typed at a terminal: Ctrl-C not ignored. A job a non-interactive shell put in the background
    # (CI's, for one) starts with SIGINT ignored, and run_interruptible leaves an ignored SIGINT alone
    signal.signal(signal.SIGINT, signal.default_int_handler)

    async def child(i):
        try:
            while True:
                began = time.monotonic()
                while time.monotonic() - began < 0.05:
                    pass
                await asyncio.sleep(0)
        finally:
            print(f"child {i} unwound", flush=True)

    async def main():
        print("ready", signal.getsignal(signal.SIGINT), flush=True)
        await asyncio.gather(child(0), child(1))

    stop_on_sigterm()
    try:
        {RUN}(main())
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
""")


def stopped_by(sig: signal.Signals, run: str = "run_interruptible") -> subprocess.CompletedProcess[str]:
    code = SCRIPT.replace("{RUN}", run)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout is not None
    ready = process.stdout.readline()  # "ready" and the handler SIGINT has (a hang below says which it was)
    assert ready.startswith("ready"), ready
    time.sleep(0.3)
    process.send_signal(sig)
    try:
        out, err = process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"{sig.name} did not stop it within 15 s ({ready.strip()}): {out} {err}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_cancels_the_loop_and_raises_keyboard_interrupt_where_it_was_run(sig: signal.Signals) -> None:
    done = stopped_by(sig)
    assert done.returncode == 130, done.stdout + done.stderr
    assert "child 0 unwound" in done.stdout and "child 1 unwound" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("interrupted") and "Traceback" not in done.stderr, done.stderr


def test_raising_keyboard_interrupt_in_a_child_task_is_what_printed_the_traceback() -> None:
    """The case this module exists for, shown with plain asyncio.run: the test above is not vacuous. The signal
    lands in a child task's own code nearly always, but now and then between two of its steps, in the loop's code,
    where plain asyncio.run raises it cleanly (about 1 run in 10 here): the traceback is asserted for one of up to
    five runs. The test above takes one run: run_interruptible must never print it."""
    tries = []
    for _ in range(5):
        done = stopped_by(signal.SIGTERM, run="asyncio.run")
        tries.append(done.stderr)
        if "KeyboardInterrupt" in done.stderr and "Traceback" in done.stderr:  # asyncio's log of it
            return
    raise AssertionError(f"no traceback in five runs: {tries}")


def test_a_loop_that_ends_normally_returns_its_value_and_gives_the_handlers_back() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert run_interruptible(answer()) == 42
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_loop_that_swallows_the_cancellation_is_still_a_stop() -> None:
    """A task that suppresses CancelledError (contextlib.suppress around an await) and returns: the launcher
    still stops as interrupted rather than reporting a finished run."""
    async def stubborn() -> str:
        signal.raise_signal(signal.SIGTERM)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "finished?"
        return "not cancelled"

    with pytest.raises(KeyboardInterrupt):
        run_interruptible(stubborn())


TEARDOWN = textwrap.dedent("""
    import atexit, os, signal, sys
    from lorarl.client.interrupt import leave_if_signalled, stop_on_sigterm

    # what the interpreter's teardown did to a stopped `lorarl tinker` in CI: a SIGINT at exit, after the launcher
    # had stopped its services and chosen its exit code
    atexit.register(lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL), os.kill(os.getpid(), signal.SIGINT)))
    stop_on_sigterm()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
    except KeyboardInterrupt:
        print("services stopped", flush=True)
    {LEAVE}
    sys.exit(130)
""")


@pytest.mark.parametrize("leave", [True, False], ids=["left", "teardown"])
def test_a_launcher_a_signal_stopped_exits_with_its_own_code_not_by_its_teardown(leave: bool) -> None:
    """leave_if_signalled (what `lorarl`'s entry point calls once a command returns): a launcher SIGTERM stopped
    exits 130 with what it printed, whatever its interpreter's teardown would do; without it the same process dies
    by the SIGINT its teardown sends (the check that this test can fail)."""
    code = TEARDOWN.replace("{LEAVE}", "leave_if_signalled(130)" if leave else "")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout == "services stopped\n", done.stdout + done.stderr
    assert done.returncode == (130 if leave else -signal.SIGINT), done.returncode
