"""Job and replica ids, and version numbers: what every process accepts, so an id is safe as a file name.

An id is 1-128 characters of letters, digits, '.', '_' and '-', starting with a letter or digit:
no separator, no newline, no NUL ever reaches the filesystem or a log line through one. Versions
stay below 2**53, so they survive every JSON parser exactly.
"""

from __future__ import annotations

import re

ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ID_RULE = "1-128 characters of letters, digits, '.', '_' and '-', starting with a letter or digit"
MAX_VERSION = (1 << 53) - 1


def is_id(value: str) -> bool:
    return bool(ID.fullmatch(value or ""))
