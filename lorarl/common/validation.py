"""Checks on values that come from outside (RPC fields, files): each raises InvalidArgumentError naming
the field and the bound, and quotes at most QUOTE_CHARS of what it was given."""

from __future__ import annotations

import math

from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.ids import ID_RULE, MAX_VERSION, is_id

QUOTE_CHARS = 200
MAX_PATH_CHARS = 4096


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length stated."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str | bytes) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"


def check_id(field: str, value: str) -> str:
    if not is_id(value):
        raise InvalidArgumentError(field, f"{quote(value)} is not an id: {ID_RULE}")
    return value


def check_version(field: str, value: int, minimum: int = 0) -> int:
    if not minimum <= value <= MAX_VERSION:
        raise InvalidArgumentError(field, f"{value} is out of range: versions are {minimum}..{MAX_VERSION}")
    return value


def check_finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidArgumentError(field, f"must be a finite number, got {value}")
    return value


def check_address(field: str, value: str) -> str:
    """host:port (an IPv6 host in brackets), as a client would dial it."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(value) > 300 \
            or any(c.isspace() or c in "/\x00" for c in value):
        raise InvalidArgumentError(field, f"{quote(value)} is not host:port")
    return value


def check_path(field: str, value: str, max_chars: int = MAX_PATH_CHARS) -> str:
    """A path as text: no NUL byte, at most ``max_chars`` characters (where it may point is the caller's rule)."""
    if "\x00" in value:
        raise InvalidArgumentError(field, f"{quote(value)} holds a NUL byte")
    if len(value) > max_chars:
        raise InvalidArgumentError(field, f"is {len(value)} characters long; paths are at most {max_chars}")
    return value
