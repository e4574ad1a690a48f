"""How long lorarl's HTTP servers (the OpenAI-compatible endpoint, the Tinker front) keep an idle connection.

Longer than the idle expiry of the clients that call them (httpx, and so `openai` and `tinker`: 5 s), so the
client is the side that drops an idle connection. At uvicorn's default, also 5 s, the two closed together: a
request sent on a connection the server was just closing failed with ReadError, which a caller that does not
retry sees as a failed call (an agent job's session fetch died so in CI, tests/e2e/test_multitenant.py).
"""

KEEP_ALIVE_S = 75
