"""A typed config field with a validity check and a description: how every typed section declares its keys.

The contract's specs (lorarl.contract.training) and every service's settings and job-file sections
(lorarl.common.config reads them) declare fields the same way, so the loader checks each value and the
generated key reference (docs/job-file.md) documents each key from one place. It lives in the contract, the
lowest layer, because the contract's specs use it and the contract imports nothing of lorarl's above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

#: Returns None when the value is fine, else what was expected (e.g. "an integer in 0..65535").
Check = Callable[[Any], str | None]

#: The field metadata key a check is kept under (lorarl.common.config reads it when it builds a section).
CHECK_KEY = "lorarl.check"


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    check: Check | None = None,
    doc: str = "",
) -> Any:
    """A dataclass field with an optional validity check and a description."""
    metadata: dict[str, Any] = {"doc": doc}
    if check is not None:
        metadata[CHECK_KEY] = check
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)
