"""Resuming a run whose job file changed: what may change and what may not, decided before any service starts.

A run directory's resume point (state.json: a trainer checkpoint of adapter and optimiser, the loop's step and
data cursor) means something only under the settings it was saved with. ``resume_config.json`` beside it holds
the job's settings as its last start had them (model.path as the job file named it: a Hub id, or the path as
written, so a moved checkout is the same model; the weights themselves are checked against the checkpoint's
fingerprint when it loads). When `lorarl run` (or `lorarl train`) would resume, the job's settings now are
compared with those: a change to a key in ``STATE_KEYS`` refuses the run, naming each change and --fresh; any
other change (more steps, another eval cadence, quieter output, other service sizes) goes ahead with a one-line
note. A directory written before this file existed is compared with its config.json, model.path left out.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.client.job.config import JobFileConfig, base_model_name
from lorarl.common.config import describe_keys, to_dict

SAVED = "resume_config.json"
#: What every run wrote before resume_config.json: the resolved job (model.path is a folder of this host there).
LEGACY = "config.json"

#: The keys (a section stands for every key under it) that decide what a saved resume point means, and why.
STATE_KEYS: dict[str, str] = {
    "job_id": "the trainer's job and its checkpoints are named by it",
    "model.path": "the base the adapter was trained on (as the job file names it)",
    "model.dtype": "the precision the adapter and optimiser state were trained in",
    "trainer.engine": "the engine that wrote the checkpoint",
    "trainer.lora": "the adapter's shape and scale",
    "trainer.loss": "the objective the adapter was trained by",
    "trainer.optimizer": "the optimiser's state and schedule",
    "loop.mode": "the loss's staleness mask (an async loop's)",
    "loop.max_staleness": "the loss's staleness mask",
    "loop.prompts_per_step": "a step's batch (the data cursor is the step times this)",
    "rollout.group_size": "a step's batch (advantages are relative within a group)",
    "data.source": "the data cursor counts into this data",
    "data.train_path": "the data cursor counts into this data",
    "data.dataset": "the data cursor counts into this data",
    "data.config": "the data cursor counts into this data",
    "data.train_split": "the data cursor counts into this data",
    "data.tasks": "the data cursor counts into this data",
    "data.columns": "the prompts and answers trained on",
    "data.seed": "the data cursor counts into this shuffle of the data",
    "data.reward": "the objective the adapter was trained by",
    "workflow.name": "the episodes the adapter was trained on",
}


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {json.dumps(self.old)} -> {json.dumps(self.new)}"


def settings(cfg: JobFileConfig) -> dict[str, Any]:
    """The job's settings as compared and saved: JSON-ready, model.path as the job file named it."""
    values = json.loads(json.dumps(to_dict(cfg)))
    values["model"]["path"] = base_model_name(cfg)
    return values


def save_settings(cfg: JobFileConfig, out: Path) -> None:
    """Records the settings this start runs under (any state it saves is saved under them)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{SAVED}.tmp"
    tmp.write_text(json.dumps(settings(cfg), indent=2) + "\n")
    tmp.replace(out / SAVED)


def saved_settings(out: Path) -> dict[str, Any] | None:
    """The settings the run directory's state was saved under, None where no file says (or it is unreadable)."""
    for name in (SAVED, LEGACY):
        try:
            values = json.loads((out / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(values, dict):
            if name == LEGACY and isinstance(values.get("model"), dict):
                values["model"].pop("path", None)  # a folder of the host it ran on, not the name the job gave
            return values
    return None


def leaf_keys() -> list[str]:
    """Every setting of the job file as a dotted key (a mapping-valued setting, data.columns, is one key): the
    keys the job-file reference lists (lorarl.common.config.describe_keys)."""
    return [k.key for k in describe_keys(JobFileConfig)]


_ABSENT = object()


def _lookup(values: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(values, dict) or part not in values:
            return _ABSENT
        values = values[part]
    return values


def is_state_key(key: str) -> bool:
    return any(key == k or key.startswith(f"{k}.") for k in STATE_KEYS)


def changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[Change], list[Change]]:
    """(changes to state keys, other changes) from ``saved`` to ``current``, over every setting this lorarl has;
    one the saved file does not hold (added since, or left out of it) is not compared: it cannot say."""
    refused, noted = [], []
    for key in leaf_keys():
        old, new = _lookup(saved, key), _lookup(current, key)
        if old is _ABSENT or new is _ABSENT or old == new:
            continue
        (refused if is_state_key(key) else noted).append(Change(key, old, new))
    return refused, noted


def refusal(out: Path, step: int, refused: list[Change]) -> str:
    """Why the run may not resume, each change on its own line with why it matters, and what to do."""
    lines = [f"{out} holds a resume point (step {step}) saved under other settings than this job's:"]
    for change in refused:
        why = next(w for k, w in STATE_KEYS.items() if change.key == k or change.key.startswith(f"{k}."))
        lines.append(f"  {change.key}: {json.dumps(change.old)} -> {json.dumps(change.new)}  ({why})")
    lines.append(f"Put them back to resume it, or pass --fresh to start the job over in {out} (its resume point is "
                 "then dropped), or give the job another output.dir.")
    return "\n".join(lines)


def note(out: Path, step: int, noted: list[Change]) -> str:
    return f"resuming {out} from step {step} with changed settings: " + ", ".join(str(c) for c in noted)


def resume_ok(cfg: JobFileConfig, fresh: bool) -> bool:
    """Before anything starts: False (said on stderr) when the job would resume its output dir's state under
    changed state keys; else True, a note printed for other changes, and the settings recorded for next time."""
    out = Path(cfg.output.dir)
    step = _resume_step(out)
    saved = saved_settings(out) if step is not None and not fresh else None
    if saved is not None:
        refused, noted = changes(saved, settings(cfg))
        if refused:
            print(f"lorarl: {refusal(out, step, refused)}", file=sys.stderr)
            return False
        if noted:
            print(f"lorarl: {note(out, step, noted)}", flush=True)
    save_settings(cfg, out)
    return True


def _resume_step(out: Path) -> int | None:
    """The step of the output dir's resume point (state.json, lorarl.client.rl.session), None when there is none."""
    try:
        return int(json.loads((out / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
