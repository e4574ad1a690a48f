"""How a launcher stops on SIGTERM (scancel, kubectl delete, `lorarl stop`, a supervisor): as on Ctrl-C.

Outside an event loop (services starting, a front waiting) SIGTERM raises KeyboardInterrupt where the main
thread is, as SIGINT does. Inside one, raising it there is wrong: the signal lands in whatever frame runs —
a child task's prompt rendering, gRPC's completion callback — and the exception escapes that task, not the
loop. asyncio then logs "unhandled exception during asyncio.run() shutdown" with a traceback, or gRPC turns
it into an error and the launcher exits 1 (both seen in CI). ``run_interruptible`` does for SIGTERM and SIGINT
what ``asyncio.Runner`` does for SIGINT alone: the first signal cancels the main task, whose awaits unwind
and whose child tasks are cancelled with it, and KeyboardInterrupt is raised from the ``run_interruptible``
call once it has; a second signal raises at once, for a loop that does not stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, as SIGINT does: the launcher's own `except
    KeyboardInterrupt` stops its services and exits 130 either way."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def run_interruptible(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, where SIGTERM (and SIGINT, unless someone else handles it) cancels ``main``
    and then raises KeyboardInterrupt here, never inside the frame the signal happened to land in."""
    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        task = loop.create_task(main)
        signals = 0

        def on_signal(signum: int, frame: Any) -> None:
            nonlocal signals
            signals += 1
            if signals == 1 and not task.done():
                task.cancel()
                loop.call_soon_threadsafe(lambda: None)  # wake a loop blocked in select()
                return
            raise KeyboardInterrupt

        caught = [signal.SIGTERM]
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # Ctrl-C not ignored, nor handled
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
