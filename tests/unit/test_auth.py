"""Bearer-token sources and the check applied to every RPC's metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.common import auth
from lorarl.common.auth import BearerTokenCheck, resolve_token, server_token, tokens_match
from lorarl.common.config import ConfigError
from lorarl.common.server_config import AuthConfig

TOKEN = "correct-horse-battery-staple"


def test_right_token_passes() -> None:
    check = BearerTokenCheck(TOKEN)
    assert check.problem([("authorization", f"Bearer {TOKEN}")]) is None
    assert check.problem([("other", "x"), ("authorization", f"bearer  {TOKEN} ")]) is None
    assert check.problem([("authorization", f"Bearer {TOKEN}".encode())]) is None


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        (None, "missing credentials"),
        ([], "missing credentials"),
        ([("x-token", TOKEN)], "missing credentials"),
        ([("authorization", TOKEN)], "malformed"),
        ([("authorization", f"Basic {TOKEN}")], "malformed"),
        ([("authorization", "Bearer ")], "malformed"),
        ([("authorization", "Bearer nope")], "invalid bearer token"),
        ([("authorization", f"Bearer {TOKEN}x")], "invalid bearer token"),
        ([("authorization", f"Bearer {TOKEN[:-1]}")], "invalid bearer token"),
    ],
)
def test_bad_credentials_get_an_actionable_message(metadata: list | None, expected: str) -> None:
    problem = BearerTokenCheck(TOKEN, token_hint="$MY_TOKEN").problem(metadata)
    assert problem is not None and expected in problem
    assert TOKEN not in problem  # never leak the server's token
    assert "nope" not in problem  # nor echo what was presented
    if expected != "malformed":
        assert "$MY_TOKEN" in problem


def test_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    check = BearerTokenCheck(TOKEN)
    assert check.problem([("authorization", "Bearer guess")]) is not None
    assert check.problem([("authorization", f"Bearer {TOKEN}")]) is None
    assert calls == [(b"guess", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]
    assert tokens_match("é", "é") and not tokens_match("é", "e")


def test_empty_token_is_refused() -> None:
    with pytest.raises(ValueError):
        BearerTokenCheck("")


def test_token_sources_in_order(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text(" from-file\n")
    env = {"LORARL_AUTH_TOKEN": "from-env", "OTHER": "other-env"}
    assert resolve_token(token="inline", token_file=file, env=env) == "inline"
    assert resolve_token(token_file=file, env=env) == "from-file"
    assert resolve_token(env=env) == "from-env"
    assert resolve_token(token_env="OTHER", env=env) == "other-env"
    assert resolve_token(token_env=None, env=env) is None
    assert resolve_token(env={"LORARL_AUTH_TOKEN": "  "}) is None
    assert resolve_token(env={}) is None


def test_token_file_problems(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError) as info:
        resolve_token(token_file=empty, env={})
    assert info.value.key == "token_file" and "empty" in info.value.problem
    with pytest.raises(ConfigError) as info:
        server_token(AuthConfig(token_file=str(tmp_path / "missing")), env={}, host="127.0.0.1")
    assert info.value.key == "server.auth.token_file"


def test_required_token_must_exist() -> None:
    assert server_token(AuthConfig(required=True), env={"LORARL_AUTH_TOKEN": "t"}, host="127.0.0.1") == "t"
    with pytest.raises(ConfigError) as info:
        server_token(AuthConfig(required=True), env={}, host="127.0.0.1")
    assert info.value.key == "server.auth.required"
    assert "$LORARL_AUTH_TOKEN" in str(info.value)


def test_a_service_fails_closed_without_a_token() -> None:
    """No token, no start; the explicit opt-out holds on a loopback host only."""
    with pytest.raises(ConfigError, match="no token was found"):
        server_token(AuthConfig(), env={}, host="127.0.0.1")  # required is the default
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.7"):
        assert server_token(AuthConfig(required=False), env={}, host=host) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "trainer"):
        with pytest.raises(ConfigError, match="loopback host only") as info:
            server_token(AuthConfig(required=False), env={}, host=host)
        assert info.value.key == "server.auth.required"
    assert server_token(AuthConfig(required=False), env={"LORARL_AUTH_TOKEN": "t"}, host="0.0.0.0") == "t"


def test_bearer_metadata() -> None:
    assert auth.bearer_metadata("t") == (("authorization", "Bearer t"),)
