"""Training checkpoints: adapters, optimiser, RNGs, counters and a data cursor, with no pickle.

Layout of a checkpoint directory:

    manifest.json            format version, base model fingerprint, LoRA and loss config,
                             step/version, and the size + sha256 of every other file
    trainable.safetensors    trainable parameters by model parameter name
    optimizer.safetensors    optimiser state tensors, keyed ``<param name>/<state key>``
    rng.safetensors          torch RNG states (CPU, CUDA)
    state.json               everything else: optimiser hyper-parameters and scalar state, python and
                             numpy RNG states, parameter order, step, version, data cursor

A save writes into a temporary sibling directory and renames it into place only when every file is
written and synced, so a failed save never touches the last good checkpoint. A load checks the
manifest against the running job (same base model, same LoRA shape) and every file against its
checksum before reading a single tensor into the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from lorarl.trainer.engines.devices import capture_accelerator_rng, restore_accelerator_rng
from lorarl.trainer.rl.lora import LoraConfig

FORMAT = "lorarl-trainer-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARAMS_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "state.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be written or used; the message says why."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is intact but belongs to another base model or adapter shape."""


class CheckpointCorruptError(CheckpointError):
    """A file is missing, truncated, garbled or fails its checksum."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint must agree on with the job that loads it (loss is recorded, not enforced)."""

    base_model_fingerprint: str
    lora: dict[str, Any] | None
    loss: dict[str, Any]
    full_finetune: bool
    dtype: str
    # Recorded for offline export (lorarl.trainer.engines.offline_export), not compared on load: where the base
    # was, and the name its adapters record as their base (TrainingSpec.base_model_name; "": the path).
    base_model_path: str = ""
    engine: str = "torch"
    base_model_name: str = ""

    def mismatches(self, other: CheckpointMeta) -> list[str]:
        problems = []
        if self.base_model_fingerprint != other.base_model_fingerprint:
            problems.append(f"base model fingerprint {other.base_model_fingerprint} != this job's "
                            f"{self.base_model_fingerprint}")
        if self.full_finetune != other.full_finetune:
            problems.append(f"full_finetune {other.full_finetune} != this job's {self.full_finetune}")
        mine, theirs = self.lora or {}, other.lora or {}
        for key in sorted(mine.keys() | theirs.keys()):
            if mine.get(key) != theirs.get(key):
                problems.append(f"lora.{key} {theirs.get(key)!r} != this job's {mine.get(key)!r}")
        return problems


def lora_identity(lora: LoraConfig) -> dict[str, Any]:
    """The LoRA fields that decide adapter shapes and meaning (not the init seed)."""
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": sorted(lora.target_modules), "expert_mode": lora.expert_mode,
            "use_rslora": lora.use_rslora}


@dataclass
class TrainingState:
    """Everything an engine needs to continue bit-exactly where it stopped."""

    step: int
    version: int
    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # torch Optimizer.state_dict() (integer parameter indices)
    param_names: list[str]  # optimiser index -> parameter name
    rng_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    data_cursor: Any = None


# ---------------------------------------------------------------- RNG


def capture_rng(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch (CPU, and the CUDA or NPU devices when used), python and numpy generator states."""
    tensors = {"torch_cpu": torch.get_rng_state(), **capture_accelerator_rng(device)}
    version, state, gauss = random.getstate()
    plain: dict[str, Any] = {"python": [version, list(state), gauss]}
    with contextlib.suppress(ImportError):
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        plain["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return tensors, plain


def restore_rng(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    restore_accelerator_rng(tensors)
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    if "numpy" in plain:
        import numpy as np

        name, keys, pos, has_gauss, cached = plain["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------- optimiser state <-> tensors + JSON


def _split_optimizer(state_dict: dict[str, Any], names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        name = names[index]
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state_dict["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _join_optimizer(tensors: dict[str, torch.Tensor], plain: dict[str, Any], names: list[str]) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, entry = key.rpartition("/")
        if name not in index:
            raise CheckpointCorruptError(f"{OPTIMIZER_FILE} has state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[entry] = value
    for name, entries in plain["scalars"].items():
        if name not in index:
            raise CheckpointCorruptError(f"{STATE_FILE} has optimiser state for unknown parameter {name!r}")
        state.setdefault(index[name], {}).update(entries)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in plain["param_groups"]]
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------- atomic directory


def _write_file(path: Path, data: bytes) -> None:
    """Writes and fsyncs one file (a seam for tests that inject a failure mid-save)."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yields a temporary sibling directory that replaces ``final`` only if the block succeeds.

    POSIX cannot atomically replace a non-empty directory, so the old one is first renamed aside
    and put back if the second rename fails; a crash between the two leaves it under ``.old-``.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_dir(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            old.rmdir()
            final.rename(old)
            try:
                tmp.rename(final)
            except BaseException:
                old.rename(final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- save / load


def save_checkpoint(path: str | Path, meta: CheckpointMeta, state: TrainingState) -> Path:
    """Writes ``state`` under ``path`` atomically; raises CheckpointError (old checkpoint intact)."""
    final = Path(path)
    try:
        cursor_json = json.loads(json.dumps(state.data_cursor))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"data_cursor must be JSON-serialisable: {e}") from e
    opt_tensors, opt_plain = _split_optimizer(state.optimizer, state.param_names)
    plain = {"step": state.step, "version": state.version, "param_names": state.param_names,
             "optimizer": opt_plain, "rng": state.rng, "data_cursor": cursor_json}
    payloads = {
        PARAMS_FILE: save_safetensors({k: v.detach().cpu().contiguous() for k, v in state.params.items()}),
        OPTIMIZER_FILE: save_safetensors(opt_tensors),
        RNG_FILE: save_safetensors({k: v.cpu().contiguous() for k, v in state.rng_tensors.items()}),
        STATE_FILE: json.dumps(plain).encode(),
    }
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "created_at": time.time(),
        "base_model_fingerprint": meta.base_model_fingerprint, "lora": meta.lora, "loss": meta.loss,
        "full_finetune": meta.full_finetune, "dtype": meta.dtype, "step": state.step, "version": state.version,
        "base_model_path": meta.base_model_path, "engine": meta.engine, "base_model_name": meta.base_model_name,
        "files": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                  for name, data in payloads.items()},
    }
    try:
        with atomic_directory(final) as tmp:
            for name, data in payloads.items():
                _write_file(tmp / name, data)
            _write_file(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
    except OSError as e:
        raise CheckpointError(f"saving checkpoint to {final} failed (previous checkpoint kept): {e}") from e
    return final


def read_manifest(path: str | Path) -> dict[str, Any]:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint directory at {root}")
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError as e:
        raise CheckpointCorruptError(f"checkpoint {root} has no {MANIFEST}") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"checkpoint {root}: {MANIFEST} is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"checkpoint {root}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {root} has format version {manifest.get('format_version')}, "
                              f"this trainer reads {FORMAT_VERSION}")
    return manifest


def _verified_bytes(root: Path, name: str, manifest: dict[str, Any]) -> bytes:
    entry = manifest.get("files", {}).get(name)
    if not isinstance(entry, dict):
        raise CheckpointCorruptError(f"checkpoint {root}: {MANIFEST} does not list {name}")
    try:
        data = (root / name).read_bytes()
    except FileNotFoundError as e:
        raise CheckpointCorruptError(f"checkpoint {root} is missing {name}") from e
    if len(data) != entry.get("bytes"):
        raise CheckpointCorruptError(f"checkpoint {root}: {name} has {len(data)} bytes, expected {entry.get('bytes')} "
                                "(truncated or overwritten)")
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise CheckpointCorruptError(f"checkpoint {root}: {name} fails its sha256 checksum")
    return data


def _tensors(root: Path, name: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    data = _verified_bytes(root, name, manifest)
    try:
        return load_safetensors(data)
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise CheckpointCorruptError(f"checkpoint {root}: {name} is not a valid safetensors file ({e})") from e


def load_checkpoint(path: str | Path, expected: CheckpointMeta,
                    param_shapes: dict[str, tuple[int, ...]]) -> TrainingState:
    """Reads and verifies a checkpoint for a job described by ``expected`` with these parameters."""
    root = Path(path)
    manifest = read_manifest(root)
    found = CheckpointMeta(base_model_fingerprint=manifest.get("base_model_fingerprint", ""),
                           lora=manifest.get("lora"), loss=manifest.get("loss", {}),
                           full_finetune=bool(manifest.get("full_finetune")), dtype=manifest.get("dtype", ""))
    problems = expected.mismatches(found)
    if problems:
        raise CheckpointMismatchError(f"checkpoint {root} does not fit this job: " + "; ".join(problems))
    params = _tensors(root, PARAMS_FILE, manifest)
    have = {k: tuple(v.shape) for k, v in params.items()}
    if have != param_shapes:
        missing = sorted(param_shapes.keys() - have.keys())[:3]
        extra = sorted(have.keys() - param_shapes.keys())[:3]
        wrong = sorted(k for k in have.keys() & param_shapes.keys() if have[k] != param_shapes[k])[:3]
        raise CheckpointMismatchError(f"checkpoint {root} parameters do not fit this job: missing {missing}, "
                                 f"unexpected {extra}, wrong shape {wrong}")
    optimizer_tensors = _tensors(root, OPTIMIZER_FILE, manifest)
    rng_tensors = _tensors(root, RNG_FILE, manifest)
    try:
        plain = json.loads(_verified_bytes(root, STATE_FILE, manifest))
        names = list(plain["param_names"])
        optimizer = _join_optimizer(optimizer_tensors, plain["optimizer"], names)
        return TrainingState(step=int(plain["step"]), version=int(plain["version"]), params=params,
                             optimizer=optimizer, param_names=names, rng_tensors=rng_tensors,
                             rng=plain["rng"], data_cursor=plain["data_cursor"])
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointCorruptError(f"checkpoint {root}: {STATE_FILE} is malformed ({e})") from e
