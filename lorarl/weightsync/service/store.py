"""Durable state of the weight-sync service on local disk: jobs, manifests, adapter bytes.

A restart must lose nothing a trainer was told succeeded, and a late replica must be able to get the
current policy from here. Only protobuf binary/JSON and safetensors are written (never pickle), and
every file appears atomically (temporary file, fsync, rename, fsync of the directory).

    <root>/jobs/<job_id>/job.binpb                 RegisterJobRequest as registered
                         job.json                  the same, readable
                         mode.json                 resolved mode and reason
                         state.json                {"active_version": N}
                         v<version:012d>/manifest.binpb|json   manifest as published
                                         adapter.binpb|json    the durable adapter's manifest
                                         adapter.safetensors   its tensors (present = durable)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from google.protobuf import json_format
from google.protobuf.message import Message
from safetensors.torch import load_file

from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.wire.payload import PROTO_TO_DTYPE, PayloadError, PayloadVerifier, checksum, tensor_bytes

_VERSION_DIR = re.compile(r"^v(\d{12})$")
ADAPTER_FILE = "adapter.safetensors"
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                       torch.int32: "I32", torch.uint8: "U8"}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes) -> None:
    """Writes `data` to `path` so a reader (or a crash) sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_synced(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _proto_files(directory: Path, stem: str, message: Message, atomic: bool = True) -> None:
    """<stem>.binpb (what is read back, synced) and <stem>.json (a copy for people, not synced);
    `atomic=False` inside a temporary directory that is renamed into place afterwards."""
    write = atomic_write if atomic else _write_synced
    write(directory / f"{stem}.binpb", message.SerializeToString(deterministic=True))
    text = json_format.MessageToJson(message, preserving_proto_field_name=True, indent=1)
    (directory / f"{stem}.json").write_text(text)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format written straight from (possibly shared) views: no copies, fsynced."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(tensor_bytes(t))
        f.flush()
        os.fsync(f.fileno())


def buckets_from_tensors(manifest: common_pb2.WeightManifest, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Re-packs tensors at the manifest's offsets; bucket checksums prove the bytes are the published ones."""
    buffers = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in manifest.buckets]
    for spec in manifest.tensors:
        t = tensors.get(spec.name)
        if t is None:
            raise PayloadError(f"stored payload lacks tensor {spec.name}")
        if t.dtype != PROTO_TO_DTYPE[spec.dtype] or list(t.shape) != list(spec.shape):
            raise PayloadError(f"stored tensor {spec.name} has dtype {t.dtype} shape {list(t.shape)}")
        buffers[spec.bucket][spec.offset: spec.offset + spec.nbytes] = t.contiguous().reshape(-1).view(torch.uint8)
    for b, buf in zip(manifest.buckets, buffers, strict=True):
        if checksum(buf) != b.checksum:
            raise PayloadError(f"stored bucket {b.index}: checksum mismatch (disk corruption?)")
    return buffers


@dataclass
class StoredVersion:
    version: int
    manifest: common_pb2.WeightManifest
    adapter: common_pb2.WeightManifest
    durable: bool


@dataclass
class StoredJob:
    request: weightsync_pb2.RegisterJobRequest
    mode: int
    reason: str
    active_version: int
    versions: dict[int, StoredVersion] = field(default_factory=dict)


class DurableStore:
    """Reads and writes the layout in the module docstring under `root`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)  # created on the first write, so an idle service leaves nothing behind

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id

    def version_dir(self, job_id: str, version: int) -> Path:
        return self.job_dir(job_id) / f"v{version:012d}"

    def save_job(self, request: weightsync_pb2.RegisterJobRequest, mode: int, reason: str) -> None:
        directory = self.job_dir(request.job_id)
        directory.mkdir(parents=True, exist_ok=True)
        _proto_files(directory, "job", request)
        atomic_write(directory / "mode.json", json.dumps({"mode": mode, "reason": reason}).encode())

    def save_active(self, job_id: str, version: int) -> None:
        atomic_write(self.job_dir(job_id) / "state.json", json.dumps({"active_version": version}).encode())

    def save_manifests(self, manifest: common_pb2.WeightManifest, adapter: common_pb2.WeightManifest) -> None:
        """Records an accepted version (before its bytes): versions never move back after a restart."""
        final = self.version_dir(manifest.job_id, manifest.version)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _proto_files(tmp, "manifest", manifest, atomic=False)  # the directory appears whole, by rename
        _proto_files(tmp, "adapter", adapter, atomic=False)
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(final.parent)

    def save_adapter(self, adapter: common_pb2.WeightManifest, buffers: list[torch.Tensor],
                     tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Writes the adapter's tensors as safetensors (atomically); `tensors`: already verified views of
        `buffers`, else the buckets are verified here first."""
        if tensors is None:
            verifier = PayloadVerifier(adapter)
            for b in adapter.buckets:
                verifier.feed(b.index, buffers[b.index], 0, buffers[b.index].numel())
            tensors = verifier.finish()
        ordered = {t.name: tensors[t.name] for t in adapter.tensors}
        target = self.version_dir(adapter.job_id, adapter.version) / ADAPTER_FILE
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        write_safetensors(tmp, ordered, {"job_id": adapter.job_id, "version": str(adapter.version)})
        os.replace(tmp, target)
        _fsync_dir(target.parent)

    def load_adapter(self, job_id: str, version: int, adapter: common_pb2.WeightManifest) -> list[torch.Tensor]:
        """The adapter's bucket buffers, re-packed from disk and checked against the manifest."""
        path = self.version_dir(job_id, version) / ADAPTER_FILE
        return buckets_from_tensors(adapter, load_file(str(path)))

    def prune(self, job_id: str, keep: int, protect: set[int]) -> list[int]:
        """Deletes all but the newest `keep` versions (never those in `protect`); returns the deleted."""
        versions = sorted(self._version_numbers(job_id), reverse=True)
        doomed = [v for v in versions[keep:] if v not in protect]
        for v in doomed:
            shutil.rmtree(self.version_dir(job_id, v), ignore_errors=True)
        return doomed

    def _version_numbers(self, job_id: str) -> Iterator[int]:
        for entry in self.job_dir(job_id).iterdir():
            m = _VERSION_DIR.match(entry.name)
            if m and entry.is_dir():
                yield int(m[1])

    def load(self) -> dict[str, StoredJob]:
        """Every registered job with its versions, as written by a previous run."""
        jobs: dict[str, StoredJob] = {}
        if not (self.root / "jobs").is_dir():
            return jobs
        for directory in sorted((self.root / "jobs").iterdir()):
            job_file = directory / "job.binpb"
            if not job_file.is_file():
                continue
            request = weightsync_pb2.RegisterJobRequest.FromString(job_file.read_bytes())
            meta = json.loads((directory / "mode.json").read_text())
            state_file = directory / "state.json"
            active = json.loads(state_file.read_text())["active_version"] if state_file.is_file() else 0
            job = StoredJob(request, int(meta["mode"]), str(meta["reason"]), int(active))
            for version in self._version_numbers(request.job_id):
                vdir = self.version_dir(request.job_id, version)
                manifest = common_pb2.WeightManifest.FromString((vdir / "manifest.binpb").read_bytes())
                adapter = common_pb2.WeightManifest.FromString((vdir / "adapter.binpb").read_bytes())
                job.versions[version] = StoredVersion(version, manifest, adapter, (vdir / ADAPTER_FILE).is_file())
            jobs[request.job_id] = job
        return jobs
