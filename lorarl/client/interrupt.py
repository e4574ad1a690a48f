"""How a launcher stops on SIGTERM (scancel, kubectl delete, `lorarl stop`, a supervisor): as on Ctrl-C.

Outside an event loop (services starting, a front waiting) SIGTERM raises KeyboardInterrupt where the main
thread is, as SIGINT does. Inside one, raising it there is wrong: the signal lands in whatever frame runs —
a child task's prompt rendering, gRPC's completion callback — and the exception escapes that task, not the
loop. asyncio then logs "unhandled exception during asyncio.run() shutdown" with a traceback, or gRPC turns
it into an error and the launcher exits 1 (both seen in CI). ``run_interruptible`` does for SIGTERM and SIGINT
what ``asyncio.Runner`` does for SIGINT alone: the first signal cancels the main task, whose awaits unwind
and whose child tasks are cancelled with it, and KeyboardInterrupt is raised from the ``run_interruptible``
call once it has; a second signal raises at once, for a loop that does not stop.

A launcher that a signal stopped leaves by ``leave_if_signalled`` once its command returns: its services are
stopped and its exit code known, and the interpreter's own teardown (daemon threads such as the Tinker front's,
atexit hooks, the native libraries' destructors) is skipped. In that teardown a `lorarl tinker` stopped by SIGTERM
while its front started, its services already gone, died by SIGINT (-2) with nothing printed, where it exits 130
(once in CI, once in twenty loaded runs here; which code sent the SIGINT was not pinned down). A supervisor reads
that as a kill where there was an orderly stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


_signalled = False


def _raise_interrupt(signum: int, frame: Any) -> None:
    global _signalled
    _signalled = True
    raise KeyboardInterrupt


def forget_signals() -> None:
    """A new command starts: no signal has stopped it yet."""
    global _signalled
    _signalled = False


def leave_if_signalled(code: int) -> None:
    """After a command a signal stopped (its cleanup done): flush what it printed and exit with ``code`` now,
    without the interpreter's teardown (see the module docstring). Returns when no signal stopped it."""
    if not _signalled:
        return
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more to say
            stream.flush()
    os._exit(code)


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, as SIGINT does: the launcher's own `except
    KeyboardInterrupt` stops its services and exits 130 either way. Ctrl-C does the same (unless something
    else handles or ignores SIGINT), so either signal is known to ``leave_if_signalled``."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_interrupt)


def run_interruptible(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, where SIGTERM (and SIGINT, unless someone else handles it) cancels ``main``
    and then raises KeyboardInterrupt here, never inside the frame the signal happened to land in."""
    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        task = loop.create_task(main)
        signals = 0

        def on_signal(signum: int, frame: Any) -> None:
            global _signalled
            nonlocal signals
            signals += 1
            _signalled = True
            if signals == 1 and not task.done():
                task.cancel()
                loop.call_soon_threadsafe(lambda: None)  # wake a loop blocked in select()
                return
            raise KeyboardInterrupt

        caught = [signal.SIGTERM]
        if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _raise_interrupt):  # Ctrl-C: not ignored
            caught.append(signal.SIGINT)
        previous = {sig: signal.signal(sig, on_signal) for sig in caught}
        try:
            result = loop.run_until_complete(task)
        except asyncio.CancelledError:
            if signals:
                raise KeyboardInterrupt from None
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if signals:  # the loop swallowed the cancellation and ended: still a stop, not a finished run
            raise KeyboardInterrupt
        return result
