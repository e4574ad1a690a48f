"""One HTTP connection pool for every episode's calls to the OpenAI-compatible endpoint.

An agent asks ``ctx.openai_client()`` once per episode. A new ``openai.AsyncOpenAI`` builds a new httpx client,
and a new httpx client builds an SSL context (it loads the CA bundle: tens of milliseconds of CPU) and opens new
connections. With 128 episodes a step plus 200 held-out ones, that was 56% of the agent job's loop process
(py-spy, examples/agent-tools.yaml). The loop owns one pool instead; each episode's client is a thin wrapper over
it (its own session header), which is how the ``openai`` docs say to share connections (``http_client=``).
"""

from __future__ import annotations

import asyncio
from typing import Any


class AgentHttp:
    """The loop's pool, made on first use (only agent jobs need it) in the event loop that uses it."""

    def __init__(self) -> None:
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def client(self) -> Any:
        """The shared ``httpx`` client (openai's defaults: 600 s timeout, 1,000 connections)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # connections belong to the loop that opened them
            import openai

            self._client, self._loop = openai.DefaultAsyncHttpxClient(), loop
        return self._client

    async def aclose(self) -> None:
        client, self._client, self._loop = self._client, None, None
        if client is not None:
            await client.aclose()
