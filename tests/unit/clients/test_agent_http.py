"""Agent episodes share the loop's one HTTP pool (lorarl.client.workflow.agent_http): two episodes' calls to the
endpoint travel over one kept-alive connection, each with its own session header, and the pool closes with the
loop. A real HTTP server on loopback counts the connections."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from lorarl.client.workflow.agent_http import AgentHttp
from lorarl.client.workflow.context import RolloutContext, SamplingDefaults

TURN = {"prompt_token_ids": [1, 2], "token_ids": [3, 4], "logprobs": [-0.1, -0.2], "versions": [1, 1],
        "finish_reason": "stop"}


class _Endpoint(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the rollout's endpoint (uvicorn) serves
    peers: ClassVar[set] = set()
    seen: ClassVar[list] = []

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.peers.add(self.client_address)
        self.seen.append(("GET", self.path, self.headers.get("Authorization")))
        self._reply({"turns": [TURN]})

    def do_DELETE(self) -> None:
        self.peers.add(self.client_address)
        self.seen.append(("DELETE", self.path, self.headers.get("Authorization")))
        self._reply({})

    def do_POST(self) -> None:
        self.peers.add(self.client_address)
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        self.seen.append(("POST", self.path, self.headers.get("X-Session-Id")))
        self._reply({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    _Endpoint.peers, _Endpoint.seen = set(), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _context(url: str, http: AgentHttp, request_id: str) -> RolloutContext:
    return RolloutContext(None, "job", 3, None, None, SamplingDefaults(1.0, 1.0, 8), 2, seed=0,
                          request_id=request_id, openai_url=url, token="secret", http=http)


def test_episodes_share_one_connection_and_keep_their_own_sessions(endpoint: str) -> None:
    async def main() -> tuple[list, AgentHttp]:
        http = AgentHttp()
        one, two = _context(endpoint, http, "b0-p0"), _context(endpoint, http, "b0-p1")
        for ctx in (one, two):
            client = ctx.openai_client()
            await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}])
        episodes = [await ctx.session_episodes() for ctx in (one, two)]
        assert one.openai_client()._client is two.openai_client()._client is http.client()
        await http.aclose()
        return episodes, http

    episodes, http = asyncio.run(main())
    assert [len(e) for e in episodes] == [1, 1] and episodes[0][0].completion_ids == [3, 4]
    assert len(_Endpoint.peers) == 1, _Endpoint.peers  # six calls, one connection: the pool kept it alive
    posts = [session for method, _, session in _Endpoint.seen if method == "POST"]
    assert len(posts) == 2 and posts[0] != posts[1] and all(p.startswith("b0-p") for p in posts)
    reads = [(m, path, auth) for m, path, auth in _Endpoint.seen if m != "POST"]
    assert [m for m, _, _ in reads] == ["GET", "DELETE", "GET", "DELETE"]  # each session read, then forgotten
    assert all(auth == "Bearer secret" for _, _, auth in reads)
    assert http._client is None  # closed with the loop


def test_a_new_event_loop_gets_its_own_pool() -> None:
    http = AgentHttp()

    async def get():
        return http.client()

    first, second = asyncio.run(get()), asyncio.run(get())
    assert first is not second  # connections of a closed loop are never reused
