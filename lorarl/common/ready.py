"""Ready files: how a server started with port 0 tells its parent where it listens.

The server writes JSON ({"service", "pid", "port", "metrics_port", "address", ...}) to a
temporary file and renames it into place, so a reader never sees a half-written file.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_ready_file(path: str | os.PathLike[str], info: Mapping[str, Any]) -> None:
    """Atomically writes `info` as JSON to `path` (write a sibling temp file, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with temporary.open("w", encoding="utf-8") as file:
        json.dump(dict(info), file)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, target)


def read_ready_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON a server wrote to its ready file."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def remove_ready_file(path: str | os.PathLike[str]) -> None:
    """Removes a (stale) ready file, if present."""
    Path(path).unlink(missing_ok=True)


def wait_for_ready_file(
    path: str | os.PathLike[str],
    *,
    timeout: float = 30.0,
    process: subprocess.Popen[Any] | None = None,
    poll_s: float = 0.02,
) -> dict[str, Any]:
    """Waits for a server's ready file; fails early if `process` exits first."""
    deadline = time.monotonic() + timeout
    target = Path(path)
    while True:
        if target.exists():
            return read_ready_file(target)
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} before writing {str(target)!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no ready file at {str(target)!r} after {timeout:.1f} s")
        time.sleep(poll_s)
