"""What the Tinker front keeps across a restart or a kill, so its clients carry on where they were.

- The state file (``tinker.state_file``): the ``tinker://`` paths clients saved (save_state checkpoints and
  sampler weights, with the PEFT exports a sampler path is restored from), the paths deleted through the REST
  API, and what is open — sessions with their tenants, training models (their trainer jobs outlive the front),
  sampling sessions, the REST API's training runs, the restored sampler paths and which jobs hold rollout slots.
  One JSON file, rewritten whole on each change through a temporary file and a rename, so a kill at any moment
  leaves the last complete state; read once when the front starts.
- The request journal (``<state file>.requests.jsonl``): each accepted request, then its outcome, appended as
  they happen — a request is far too frequent to rewrite the state for. At start it is read back: a finished
  request's outcome is retrievable again, each model's requests go on from the next ``seq_id``, and a request
  the kill caught running settles as a failure that says so (its effect on the model is unknown: nothing is
  dropped silently, nothing is run twice). The journal is then compacted to what is worth keeping.

Plain JSON (no pickle): each record is a dataclass's fields, protobuf outcomes as base64.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lorarl.tinker.futures import UserError

VERSION = 2
#: The versions this front reads (1: paths only, before sessions and models were kept).
READABLE = (1, 2)
#: Finished outcomes kept in the journal across a restart this long after they finished.
KEEP_OUTCOMES_S = 600.0
#: The journal's size at which it is compacted while the front runs (outcomes older than KEEP_OUTCOMES_S go).
MAX_JOURNAL_BYTES = 64 * 2**20
RESTARTED = ("the Tinker front restarted while this request was running: whether it took effect is unknown. "
             "Check the model (get_info, a forward) or load your last saved state, then send it again")


@dataclass
class Snapshot:
    """Everything the state file holds, as the front's own objects."""

    saved: dict[str, Any] = field(default_factory=dict)  # tinker path -> Saved
    paths: dict[str, Any] = field(default_factory=dict)  # sampler path -> Sampler
    deleted: set[str] = field(default_factory=set)
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> tenant
    models: dict[str, Any] = field(default_factory=dict)  # model id -> Model
    lora: dict[str, dict[str, Any]] = field(default_factory=dict)  # model id -> its create_model lora_config
    sampling: dict[str, dict[str, str]] = field(default_factory=dict)  # sampler id -> {owner, path | base_model}
    runs: dict[str, Any] = field(default_factory=dict)  # run id -> Run
    restored: dict[str, str] = field(default_factory=dict)  # restore job id -> the sampler path it serves
    on_rollout: dict[str, str] = field(default_factory=dict)  # job id -> tenant


@dataclass(frozen=True)
class Kinds:
    """The front's record types (lorarl.tinker.service / runs), given by the caller: no import cycle."""

    saved: type
    sampler: type
    model: type
    run: type


def _record(kind: type, record: Any, where: str) -> Any:
    """``record`` as ``kind``: kind's fields, those with a default optional (a file written before they
    existed, e.g. before tenants, reads with the default)."""
    names = {f.name for f in fields(kind)}
    required = {f.name for f in fields(kind) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(record, dict) or not required <= set(record) <= names:
        raise ValueError(f"{where} must hold {sorted(required)}, and may hold {sorted(names - required)}")
    return kind(**record)


def _records(data: dict[str, Any], key: str, kind: type, path: Path) -> dict[str, Any]:
    return {str(k): _record(kind, v, f"{path}: {key}[{k!r}]") for k, v in (data.get(key) or {}).items()}


class FrontState:
    """The front's state file (None: kept in memory only) and its request journal."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None

    @property
    def journal_path(self) -> Path | None:
        return self.path.with_name(f"{self.path.name}.requests.jsonl") if self.path else None

    def load(self, kinds: Kinds) -> Snapshot:
        """The snapshot as last written (empty where there is no file yet). A file this front cannot read is
        refused by name, never silently replaced."""
        if self.path is None or not self.path.exists():
            return Snapshot()
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: the Tinker front's state cannot be read: {e}") from None
        if not isinstance(data, dict) or data.get("version") not in READABLE:
            raise ValueError(f"{self.path}: not a Tinker front state of version {' or '.join(map(str, READABLE))}")
        try:
            return Snapshot(
                saved=_records(data, "saved", kinds.saved, self.path),
                paths=_records(data, "samplers", kinds.sampler, self.path),
                deleted={str(p) for p in data.get("deleted") or []},
                sessions={str(k): str(v) for k, v in (data.get("sessions") or {}).items()},
                models=_records(data, "models", kinds.model, self.path),
                lora={str(k): dict(v) for k, v in (data.get("lora") or {}).items()},
                sampling={str(k): {str(a): str(b) for a, b in v.items()} for k, v in
                          (data.get("sampling") or {}).items()},
                runs=_records(data, "runs", kinds.run, self.path),
                restored={str(k): str(v) for k, v in (data.get("restored") or {}).items()},
                on_rollout={str(k): str(v) for k, v in (data.get("on_rollout") or {}).items()})
        except (AttributeError, TypeError) as e:
            raise ValueError(f"{self.path}: a record of the wrong shape: {e}") from None

    def write(self, snapshot: Snapshot) -> None:
        if self.path is None:
            return
        body = {"version": VERSION, "saved": {p: asdict(s) for p, s in snapshot.saved.items()},
                "samplers": {p: asdict(s) for p, s in snapshot.paths.items()}, "deleted": sorted(snapshot.deleted),
                "sessions": snapshot.sessions, "models": {m: asdict(v) for m, v in snapshot.models.items()},
                "lora": snapshot.lora, "sampling": snapshot.sampling,
                "runs": {r: asdict(v) for r, v in snapshot.runs.items()}, "restored": snapshot.restored,
                "on_rollout": snapshot.on_rollout}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_text(json.dumps(body, indent=1))
            os.replace(temporary, self.path)
        except OSError as e:
            raise UserError(f"the front could not keep its state in {self.path}: {e}") from None


@dataclass
class Journaled:
    """A request as the journal last saw it: its tenant, its model and seq_id (ordered requests), and its
    outcome once it had one (lorarl.tinker.futures.Outcome.record)."""

    owner: str
    model: str = ""
    seq: int | None = None
    outcome: dict[str, Any] | None = None
    finished: float = 0.0


class Journal:
    """Requests accepted and settled, one JSON line each, appended (None path: nothing kept). Past
    ``max_bytes`` it is compacted in place, as at a restart but keeping the running requests running."""

    def __init__(self, path: Path | None, max_bytes: int = MAX_JOURNAL_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._file = None
        self._bytes = 0

    def _append(self, entry: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open: one line per request)
            self._bytes = self._file.tell()
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        self._file.write(line)
        self._file.flush()  # in the kernel's hands: a killed front loses nothing it appended
        self._bytes += len(line)
        if self._bytes > self.max_bytes:
            self.close()
            self._compact(fail_running=False)

    def accepted(self, request_id: str, owner: str, model: str = "", seq: int | None = None) -> None:
        self._append({"id": request_id, "owner": owner, "model": model, "seq": seq})

    def settled(self, request_id: str, outcome: dict[str, Any]) -> None:
        self._append({"id": request_id, "outcome": outcome, "at": time.time()})

    def replay(self) -> dict[str, Journaled]:
        """Every request the journal holds that is worth keeping, in the order accepted: those finished within
        KEEP_OUTCOMES_S and each model's last seq_id; a request the kill caught running settles as a failure
        naming the restart. The file is rewritten with them."""
        if self.path is None or not self.path.exists():
            return {}
        return self._compact(fail_running=True)

    def _read(self) -> dict[str, Journaled]:
        entries: dict[str, Journaled] = {}
        with open(self.path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    if line.endswith("\n"):
                        raise ValueError(f"{self.path}:{number}: not a journal line") from None
                    break  # the line a kill cut short: its request was never answered as accepted
                if "owner" in entry:
                    entries[entry["id"]] = Journaled(entry["owner"], entry.get("model") or "", entry.get("seq"))
                elif entry.get("id") in entries:
                    entries[entry["id"]].outcome, entries[entry["id"]].finished = entry["outcome"], entry["at"]
        return entries

    def _compact(self, fail_running: bool) -> dict[str, Journaled]:
        """The file rewritten with the requests worth keeping: running ones (failed by name when
        ``fail_running``: the front restarted under them), those finished within KEEP_OUTCOMES_S, and each
        model's last seq_id (where its next request goes on)."""
        entries, now = self._read(), time.time()
        if fail_running:
            for entry in entries.values():
                if entry.outcome is None:
                    entry.outcome, entry.finished = {"error": RESTARTED, "category": "user"}, now
        last_seq: dict[str, Journaled] = {}
        for entry in entries.values():
            if entry.model and entry.seq is not None and (
                    entry.model not in last_seq or entry.seq > (last_seq[entry.model].seq or 0)):
                last_seq[entry.model] = entry
        lasts = {id(e) for e in last_seq.values()}
        kept = {r: e for r, e in entries.items()
                if e.outcome is None or now - e.finished <= KEEP_OUTCOMES_S or id(e) in lasts}
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(temporary, "w", encoding="utf-8") as out:
            for request_id, entry in kept.items():
                out.write(json.dumps({"id": request_id, "owner": entry.owner, "model": entry.model,
                                      "seq": entry.seq}) + "\n")
                if entry.outcome is not None:
                    out.write(json.dumps({"id": request_id, "outcome": entry.outcome, "at": entry.finished}) + "\n")
        os.replace(temporary, self.path)
        return kept

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
