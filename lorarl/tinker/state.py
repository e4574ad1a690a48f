"""What the Tinker front keeps across a restart: the ``tinker://`` paths its clients saved (save_state checkpoints
and sampler weights, with the PEFT exports a sampler path is restored from) and the paths deleted through the
REST API. A client's saved paths are what it keeps between runs (the cookbook resumes from them, evaluates them
later); everything else a front holds (sessions, training clients, pending futures) is rebuilt by a client that
reconnects, from those paths.

One JSON file, rewritten whole on each change through a temporary file and a rename, so a kill at any moment
leaves the last complete state; read once when the front starts. Plain JSON (no pickle): each record is a
dataclass's fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from lorarl.tinker.futures import UserError

VERSION = 1


def _records(data: dict[str, Any], key: str, kind: type, path: Path) -> dict[str, Any]:
    """``data[key]`` as {tinker path: kind(**record)}, each record holding exactly kind's fields."""
    names = {f.name for f in fields(kind)}
    out = {}
    for tinker_path, record in (data.get(key) or {}).items():
        if not isinstance(record, dict) or set(record) != names:
            raise ValueError(f"{path}: {key}[{tinker_path!r}] must hold exactly {sorted(names)}")
        out[str(tinker_path)] = kind(**record)
    return out


class FrontState:
    """The front's durable paths in one file (None: kept in memory only)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None

    def load(self, saved_kind: type, sampler_kind: type) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
        """(saved, samplers, deleted) as last written; empty where there is no file yet. A file this front cannot
        read is refused by name, never silently replaced."""
        if self.path is None or not self.path.exists():
            return {}, {}, set()
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: the Tinker front's state cannot be read: {e}") from None
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"{self.path}: not a Tinker front state of version {VERSION}")
        return (_records(data, "saved", saved_kind, self.path), _records(data, "samplers", sampler_kind, self.path),
                {str(p) for p in data.get("deleted") or []})

    def write(self, saved: dict[str, Any], samplers: dict[str, Any], deleted: set[str]) -> None:
        if self.path is None:
            return
        body = {"version": VERSION, "saved": {p: asdict(s) for p, s in saved.items()},
                "samplers": {p: asdict(s) for p, s in samplers.items()}, "deleted": sorted(deleted)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_text(json.dumps(body, indent=1))
            os.replace(temporary, self.path)
        except OSError as e:
            raise UserError(f"the front could not keep its state in {self.path}: {e}") from None
