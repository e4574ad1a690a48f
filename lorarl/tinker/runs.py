"""The Tinker REST API's view of a front's work: training runs (one per training model, kept after its session
ends, so that a client's saved paths still resolve) and their checkpoints (`save_state` weights and sampler
weights, by `tinker://RUN/KIND/NAME` path), answered in the SDK's own response models (`tinker.types`), as
`tinker.RestClient` and the cookbook read them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tinker import types

#: The path segment of each checkpoint kind (tinker.types.ParsedCheckpointTinkerPath).
KINDS = {"weights": "training", "sampler_weights": "sampler"}
MAX_PAGE = 1000


class NotFoundError(LookupError):
    """An unknown run or checkpoint: HTTP 404 (the SDK's NotFoundError), never retried."""


@dataclass
class Run:
    run_id: str  # the model id
    base_model: str
    rank: int
    lora: dict[str, Any]
    owner: str = ""  # the tenant that made it: only its keys see it (lorarl.tinker.tenants)
    last_request: float = field(default_factory=time.time)
    checkpoints: dict[str, float] = field(default_factory=dict)  # tinker path -> when it was saved
    expires: dict[str, float] = field(default_factory=dict)  # tinker path -> when it expires (absent: never)


def _when(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def parse_path(path: str) -> tuple[str, str, str]:
    """(run id, kind segment, name) of a ``tinker://RUN/KIND/NAME`` path; NotFoundError naming the form otherwise."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts):
        raise NotFoundError(f"{path!r} is not a checkpoint path (tinker://RUN/weights/NAME or "
                       "tinker://RUN/sampler_weights/NAME)")
    return parts[0], parts[1], parts[2]


class Runs:
    """Every training run the front has made, and its checkpoints."""

    def __init__(self, runs: dict[str, Run] | None = None) -> None:
        self.runs: dict[str, Run] = dict(runs or {})

    def add(self, run_id: str, base_model: str, rank: int, lora: dict[str, Any], owner: str = "") -> None:
        self.runs[run_id] = Run(run_id, base_model, rank, dict(lora), owner)

    def touch(self, run_id: str) -> None:
        if run_id in self.runs:
            self.runs[run_id].last_request = time.time()

    def saved(self, path: str, expires_at: float = 0.0) -> None:
        """A checkpoint at ``path`` (its run's), saved now; ``expires_at``: when it expires (0: never)."""
        run_id, _, _ = parse_path(path)
        if run_id in self.runs:
            self.runs[run_id].checkpoints[path] = time.time()
            self._set_expiry(self.runs[run_id], path, expires_at)

    @staticmethod
    def _set_expiry(run: Run, path: str, expires_at: float) -> None:
        if expires_at:
            run.expires[path] = expires_at
        else:
            run.expires.pop(path, None)

    def set_expiry(self, run_id: str, checkpoint_id: str, expires_at: float, owner: str | None = None) -> str:
        """A checkpoint's expiry set (0: removed); its tinker path. NotFoundError for another's or none."""
        path = f"tinker://{run_id}/{checkpoint_id}"
        parse_path(path)
        run = self.run(run_id, owner)
        if path not in run.checkpoints:
            raise NotFoundError(f"training run {run_id!r} has no checkpoint {checkpoint_id!r}")
        self._set_expiry(run, path, expires_at)
        return path

    def run(self, run_id: str, owner: str | None = None) -> Run:
        """The run, when ``owner``'s (None: any); another tenant's is answered as none."""
        if run_id not in self.runs or owner not in (None, self.runs[run_id].owner):
            raise NotFoundError(f"no training run {run_id!r} on this front")
        return self.runs[run_id]

    def _checkpoint(self, path: str, when: float) -> types.Checkpoint:
        run_id, kind, name = parse_path(path)
        expires = self.runs[run_id].expires.get(path) if run_id in self.runs else None
        return types.Checkpoint(checkpoint_id=f"{kind}/{name}", checkpoint_type=KINDS[kind], time=_when(when),
                                tinker_path=path, expires_at=_when(expires) if expires else None)

    def training_run(self, run_id: str, owner: str | None = None) -> dict[str, Any]:
        run = self.run(run_id, owner)
        last = {KINDS[parse_path(p)[1]]: (p, t) for p, t in sorted(run.checkpoints.items(), key=lambda i: i[1])}
        body = types.TrainingRun(
            training_run_id=run.run_id, base_model=run.base_model, model_owner="", is_lora=True, lora_rank=run.rank,
            last_request_time=_when(run.last_request),
            last_checkpoint=self._checkpoint(*last["training"]) if "training" in last else None,
            last_sampler_checkpoint=self._checkpoint(*last["sampler"]) if "sampler" in last else None)
        return body.model_dump(mode="json")

    def training_runs(self, limit: int, offset: int, owner: str | None = None) -> dict[str, Any]:
        ids = sorted((r for r in self.runs if owner in (None, self.runs[r].owner)),
                     key=lambda r: -self.runs[r].last_request)
        page = ids[offset: offset + limit]
        body = types.TrainingRunsResponse(training_runs=[types.TrainingRun.model_validate(self.training_run(r))
                                                         for r in page],
                                          cursor=types.Cursor(offset=offset, limit=limit, total_count=len(ids)))
        return body.model_dump(mode="json")

    def checkpoints(self, run_id: str | None = None, limit: int = MAX_PAGE, offset: int = 0,
                    owner: str | None = None) -> dict[str, Any]:
        """A run's checkpoints (None: every run of ``owner``'s), newest first."""
        runs = [self.run(run_id, owner)] if run_id is not None else [
            r for r in self.runs.values() if owner in (None, r.owner)]
        found = sorted(((p, t) for r in runs for p, t in r.checkpoints.items()), key=lambda item: -item[1])
        body = types.CheckpointsListResponse(
            checkpoints=[self._checkpoint(p, t) for p, t in found[offset: offset + limit]],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=len(found)))
        return body.model_dump(mode="json")

    def drop(self, path: str) -> None:
        """A checkpoint gone from its run's listing (expired), if it is there."""
        run_id, _, _ = parse_path(path)
        if run_id in self.runs:
            self.runs[run_id].checkpoints.pop(path, None)
            self.runs[run_id].expires.pop(path, None)

    def forget(self, run_id: str, checkpoint_id: str, owner: str | None = None) -> str:
        """Drops a checkpoint (``weights/NAME`` or ``sampler_weights/NAME``) from its run; its tinker path."""
        path = f"tinker://{run_id}/{checkpoint_id}"
        parse_path(path)
        if path not in self.run(run_id, owner).checkpoints:
            raise NotFoundError(f"training run {run_id!r} has no checkpoint {checkpoint_id!r}")
        del self.runs[run_id].checkpoints[path]
        self.runs[run_id].expires.pop(path, None)
        return path

    def weights_info(self, path: str, owner: str | None = None) -> dict[str, Any]:
        run_id, _, _ = parse_path(path)
        run = self.run(run_id, owner)
        if path not in run.checkpoints:
            raise NotFoundError(f"no checkpoint at {path!r}")
        lora = run.lora
        body = types.WeightsInfoResponse(base_model=run.base_model, is_lora=True, lora_rank=run.rank,
                                         train_attn=bool(lora.get("train_attn", True)),
                                         train_mlp=bool(lora.get("train_mlp", True)),
                                         train_unembed=False)  # lorarl adapts decoder linears only
        return body.model_dump(mode="json")
