"""`lorarl run JOB.yaml --attach RUN_DIR`: one more job on a stack another `lorarl run` started and still owns.

The owner writes its services' addresses beside their token (``RUN_DIR/services/stack.json`` and ``token``,
lorarl.client.launch.local). An attached run reads them, checks its job can share those services (the same base
model, dtype, engines and rollout shape as the owner's job, adapter mode, a rank the owner's rollout serves as
an adapter: lorarl.contract.sharing) and runs its loop against them like `lorarl train`. While it runs it holds
a lease (``services/attached/JOB_ID``, its pid): when the owner's own jobs end, the owner keeps the services up
until every lease's process has exited, so an attached job is never cut off by the run that started the stack
(a run that attaches while the owner is already stopping finds the services gone and fails naming them). An
attached job syncs adapters (a merged version would replace the base every other job samples from), so its
rank must fit the rollout's (the owner's ``rollout.max_lora_rank``) and the owner's rollout must serve LoRA.
The rollout's adapter slots are the owner's (``rollout.max_loras``); a job that finds none free is refused by
the rollout with RESOURCE_EXHAUSTED naming the slots, and the owner can be started with room to spare.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lorarl.common.config import ConfigError, to_dict
from lorarl.contract import sharing
from lorarl.contract.sharing import EngineLora

LEASES = "attached"
WAIT_S = 1.0


def services_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "services"


def stack_addresses(run_dir: str | Path) -> dict[str, Any]:
    """The owner's service addresses; ConfigError naming the folder when there is no stack in it."""
    path = services_dir(run_dir) / "stack.json"
    if not path.is_file():
        raise ConfigError("--attach", f"no stack in {run_dir!s} ({path} is missing): give the output dir of a "
                                      "running `lorarl run`")
    return json.loads(path.read_text())


def check_attachable(cfg: Any, run_dir: str | Path) -> None:
    """ConfigError when ``cfg`` cannot share the owner's services: the jobs disagree on what the services are
    built from (the owner's job file as it ran), or the owner's rollout cannot serve this job's adapter as one
    (lorarl.contract.sharing: the rule `lorarl run A B` and the Tinker front apply too)."""
    owner_file = Path(run_dir) / "config.json"
    if not owner_file.is_file():
        raise ConfigError("--attach", f"{owner_file} is missing: the owner's job has not started yet")
    owner = json.loads(owner_file.read_text())
    if cfg.job_id == owner["job_id"]:
        raise ConfigError("job_id", f"{cfg.job_id!r} is the owner's job: give this one a job id of its own")
    if key := cfg.model_teacher_key():  # the owner's stack started no engine for it (or one for another model)
        raise ConfigError(key, f"the stack in {run_dir!s}: a full-model teacher's engine is started for a job of its "
                               "own only, not for a job that attaches (not built): make the teacher an adapter of "
                               "the job's base, or run the job alone")
    if problem := sharing.disagreement([(owner["job_id"], owner), (cfg.job_id, to_dict(cfg))]):
        key, why = problem
        raise ConfigError(key, f"the stack in {run_dir!s}: {why}")
    stack = stack_addresses(run_dir)
    served = stack.get("lora") or {"supports_lora": True, "max_lora_rank": stack.get("max_lora_rank") or 0}
    engine = EngineLora(bool(served["supports_lora"]), int(served["max_lora_rank"]), True,
                        str(served.get("engine", "")), str(served.get("reason", "")))
    if why := sharing.sharing_refusal(engine, cfg.trainer.lora.rank):
        raise ConfigError("trainer.lora.rank", f"the stack in {run_dir!s}: {why}")


@contextlib.contextmanager
def lease(run_dir: str | Path, job_id: str) -> Iterator[None]:
    """Holds the owner's services up while this process runs ``job_id`` on them."""
    folder = services_dir(run_dir) / LEASES
    folder.mkdir(exist_ok=True)
    path = folder / job_id
    path.write_text(str(os.getpid()))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def attached_jobs(workdir: Path) -> list[str]:
    """The jobs whose attached runs are still alive (a lease whose process is gone is dropped)."""
    live = []
    for path in sorted((workdir / LEASES).glob("*")) if (workdir / LEASES).is_dir() else []:
        try:
            pid = int(path.read_text().strip())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            live.append(path.name)
        else:
            path.unlink(missing_ok=True)
    return live


def wait_for_attached(workdir: Path, give_up: Any = None) -> None:
    """The owner's last step: keep the services up while attached runs are alive (Ctrl-C stops them)."""
    said = None
    while jobs := attached_jobs(workdir):
        if jobs != said:
            print(f"lorarl: this run's jobs are done; the services stay up for the attached job(s) "
                  f"{', '.join(jobs)} (Ctrl-C stops them)", file=sys.stderr, flush=True)
            said = jobs
        if give_up is not None:
            give_up()
        time.sleep(WAIT_S)
