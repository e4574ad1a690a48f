"""A readers/writer gate between request submission and weight switches.

Submitting a segment resolves its policy version and hands it to the engine; a weight switch must
never happen in between, or tokens would be tagged with a version that did not produce them. Many
submissions may run at once (readers); a switch (writer) waits for those in progress, blocks new
ones, and is preferred over newcomers so a stream of requests cannot starve an update.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class SwitchGate:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @property
    def switching(self) -> bool:
        return self._writer or self._writers_waiting > 0

    @asynccontextmanager
    async def submitting(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def switch(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()
