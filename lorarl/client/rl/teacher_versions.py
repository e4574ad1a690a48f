"""Teachers that are another job's published version (``distill.teachers[].job: JOB@vN``), read once.

Weight sync keeps each job's newest versions and its active one, adapters as the trainer published them. A
distilling job on the same stack (attached to the run JOB trained in, or `lorarl train` against its services)
fetches version N of JOB from there at its first start, checks it is an adapter on this job's base, and keeps it as
a PEFT directory in its own output folder (``teachers/<name>``, a few MB, written whole or not at all, with the
version it holds beside it): from then on it is an adapter teacher like any other, held on the trainer as
``<job_id>.teacher.<name>`` and published to the replicas. A later start (a resume, a restart) reuses the kept copy,
so JOB's later versions, their pruning or the owner's stack being gone change nothing for the student; ``--fresh``
reads it again. What cannot be served is refused naming the teacher's key, before the student's job is created: no
weight sync to read from, a version weight sync does not hold (its message names the ones it keeps), one on another
base. A job that syncs merged versions teaches too: weight sync keeps each version as its adapter.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import grpc

from lorarl.client.calls import ServiceCallError
from lorarl.client.job.inputs import Teacher
from lorarl.common.config import ConfigError
from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.contract.lora import LoraSpec
from lorarl.contract.peft import adapted_leaves, read_peft_config, write_peft_files
from lorarl.v1 import common_pb2
from lorarl.weightsync.client.fetch import fetch_version
from lorarl.weightsync.wire.payload import PayloadError

FOLDER = "teachers"
SOURCE = "lorarl-teacher.json"  # which job and version a kept copy holds


def keep(folder: Path, tensors: dict, config: dict, job: str, version: int) -> None:
    """The adapter written beside ``folder`` and renamed into place as a checkpoint is (the trainer's
    atomic_directory): a crash leaves the old copy or none."""
    from lorarl.trainer.engines.checkpoint import atomic_directory

    with atomic_directory(folder) as scratch:
        write_peft_files(scratch, tensors, config)
        (scratch / SOURCE).write_text(json.dumps({"job": job, "version": version}))


def kept(folder: Path, job: str, version: int) -> LoraSpec | None:
    """The LoRA spec of the copy of ``job`` v``version`` an earlier start kept in ``folder``; None when there is
    none (or it holds another version: the job file changed)."""
    try:
        source = json.loads((folder / SOURCE).read_text())
        if (source.get("job"), source.get("version")) != (job, version):
            return None
        return LoraSpec.from_peft_config(read_peft_config(folder))
    except (OSError, ValueError, KeyError, TypeError):
        return None


async def read_version_teachers(cfg: Any, teachers: list[Teacher], weightsync: Any, token: str | None, out: Path,
                                fresh: bool = False) -> list[Teacher]:
    """``teachers`` with each JOB@vN one turned into an adapter teacher: the copy an earlier start kept in
    ``out/teachers/<name>`` (unless ``fresh``), else read from ``weightsync`` (a WeightSyncService stub) and kept
    there; the others as they are."""
    model_path = str(Path(cfg.model.path).resolve())
    fingerprint = None
    resolved = []
    for i, teacher in enumerate(teachers):
        if teacher.version_of is None:
            resolved.append(teacher)
            continue
        key, (job, version) = f"distill.teachers[{i}].job", teacher.version_of
        folder = out / FOLDER / teacher.name
        if not fresh and (lora := kept(folder, job, version)) is not None:
            print(f"lorarl: teacher {teacher.name} is {job} v{version}, kept in {folder} at an earlier start",
                  flush=True)
            resolved.append(dataclasses.replace(teacher, path=str(folder), lora=lora, version_of=None))
            continue
        if weightsync is None:
            raise ConfigError(key, f"teacher {teacher.name!r} is {job}@v{version}, read from the stack's weight sync, "
                                   "and this run has none (lorarl train: pass --weightsync)")
        try:
            manifest, tensors = await fetch_version(weightsync, job, version, token)
        except ServiceCallError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
            raise ConfigError(key, f"teacher {teacher.name!r}: the stack's weight sync does not hold {job} v{version} "
                                   f"({e.details}); it keeps each job's newest versions and its active one: name one "
                                   "of those, or an export of the job (adapter:)") from None
        except PayloadError as e:
            raise ConfigError(key, f"teacher {teacher.name!r}: {job} v{version} did not arrive whole: {e}") from None
        if manifest.mode != common_pb2.SYNC_MODE_ADAPTER or not manifest.lora.rank:  # weight sync keeps adapters
            raise ConfigError(key, f"teacher {teacher.name!r}: {job} v{version} is not an adapter on weight sync "
                                   "(a merged payload): export the job and give it as model:")
        fingerprint = fingerprint or base_model_fingerprint(model_path)
        if manifest.base_model_fingerprint != fingerprint:
            raise ConfigError(key, f"teacher {teacher.name!r}: {job} v{version} was trained on another base model "
                                   f"than this job's {cfg.model.path!r}")
        published = LoraSpec.from_proto(manifest.lora)
        keep(folder, tensors, published.peft_config(model_path, adapted_leaves(tensors)), job, version)
        lora = LoraSpec.from_peft_config(read_peft_config(folder))  # as any adapter teacher's: from its folder
        print(f"lorarl: teacher {teacher.name} is {job} v{version} from weight sync (rank {lora.rank}), kept in "
              f"{folder}", flush=True)
        resolved.append(dataclasses.replace(teacher, path=str(folder), lora=lora, version_of=None))
    return resolved
