"""The file format of a co-located job's shared base (issue "one base"): what the launcher writes and every
service that computes on the base maps, so one statement of it for all of them.

The file is a valid safetensors file (8-byte header length, JSON header, tensor bytes) in the engine's layout
(lorarl.contract.base_layout), its data page-aligned; its ``__metadata__`` names the format, the base model's
fingerprint and, per shared tensor, the checkpoint tensors it holds. Written from the checkpoint's own bytes,
copied straight from the safetensors files: every part of a fused tensor is a block of rows, so a copy is a byte
range; no tensor is ever materialised, and the launcher needs no torch. Where the memory itself comes from, and
how another process reaches it, is a platform fact (lorarl.platform.shared_memory).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.contract.base_layout import Part, SharedTensor, layout
from lorarl.platform.shared_memory import SegmentError

FORMAT = "lorarl-shared-base-1"
ALIGN = 4096
#: safetensors dtype code -> bytes per element.
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return 8 + size, json.loads(f.read(size))


def checkpoint_index(model_dir: str | Path) -> dict[str, tuple[Path, int, int, tuple[int, ...], str]]:
    """Every tensor of a checkpoint: name -> (file, first byte, end byte, shape, safetensors dtype)."""
    index = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        start, header = _read_header(file)
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                index[name] = (file, start + begin, start + end, tuple(entry["shape"]), entry["dtype"])
    if not index:
        raise SegmentError(f"{model_dir} has no *.safetensors weights")
    return index


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * ITEM_BYTES[dtype]


@dataclass(frozen=True)
class Segment:
    """A mapped shared base: its layout, where each tensor's bytes lie (from the start of the mapping), the map."""

    tensors: dict[str, SharedTensor]
    offsets: dict[str, int]
    fingerprint: str
    buffer: mmap.mmap | None  # the host mapping (None for a segment only on a device)
    nbytes: int
    #: The same bytes in one device buffer (a uint8 tensor; to_device, open_device_segment), which views then slice.
    device_buffer: Any = None

    @property
    def device(self) -> str:
        return "cpu" if self.device_buffer is None else str(self.device_buffer.device)

    def views(self) -> dict[str, Any]:
        """Every shared tensor as a read-only torch tensor over the mapping (a write faults: nothing may write
        the shared base). Checkpoint tensors are ``part_views``."""
        import warnings

        import torch

        if self.device_buffer is not None:
            return {name: self.device_buffer[self.offsets[name]:self.offsets[name] + _nbytes(t.shape, t.dtype)]
                    .view(getattr(torch, TORCH_DTYPES[t.dtype])).view(t.shape) for name, t in self.tensors.items()}
        out = {}
        with warnings.catch_warnings():  # torch warns that it cannot mark a tensor read-only; the mapping is
            warnings.simplefilter("ignore", UserWarning)
            for name, t in self.tensors.items():
                count = _nbytes(t.shape, t.dtype) // ITEM_BYTES[t.dtype]
                flat = torch.frombuffer(self.buffer, dtype=getattr(torch, TORCH_DTYPES[t.dtype]), count=count,
                                        offset=self.offsets[name])
                out[name] = flat.view(t.shape)
        return out

    def part_views(self, views: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every checkpoint tensor as rows of its shared tensor (a view: same storage)."""
        views = views if views is not None else self.views()
        return {p.checkpoint: views[t.name][p.start:p.stop] for t in self.tensors.values() for p in t.parts}

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor``'s bytes lie inside this mapping (a view of the shared base, not a copy)."""
        import torch

        if self.device_buffer is not None:
            start, size = self.device_buffer.data_ptr(), self.device_buffer.numel()
        else:
            start, size = torch.frombuffer(self.buffer, dtype=torch.uint8, count=1).data_ptr(), len(self.buffer)
        begin = tensor.data_ptr()
        return tensor.numel() > 0 and start <= begin and begin + tensor.nbytes <= start + size

    def header(self) -> bytes:
        """The file's first bytes up to its data: all another process needs, with the bytes, to open it."""
        (size,) = struct.unpack("<Q", self.buffer[:8])
        return bytes(self.buffer[:8 + size])

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()


def tied_embeddings(model_dir: str | Path) -> bool:
    """Whether the checkpoint's output head is its embedding (config.json, or its text_config)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)))


def build(fd: int, model_dir: str | Path) -> int:
    """Writes ``model_dir``'s base into the memory file ``fd`` in the shared layout; returns its size in bytes."""
    from lorarl.contract.fingerprint import base_model_fingerprint

    fingerprint, tied = base_model_fingerprint(model_dir), tied_embeddings(model_dir)
    index = checkpoint_index(model_dir)
    shared = layout({n: (shape, dtype) for n, (_, _, _, shape, dtype) in index.items()}, tied)
    header: dict[str, Any] = {}
    offset = 0
    for t in shared:
        size = _nbytes(t.shape, t.dtype)
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    parts = {t.name: [[p.checkpoint, p.start, p.stop] for p in t.parts] for t in shared}
    header["__metadata__"] = {"format": FORMAT, "fingerprint": fingerprint, "parts": json.dumps(parts)}
    raw = json.dumps(header).encode()
    data_start = -(-(8 + len(raw)) // ALIGN) * ALIGN
    raw += b" " * (data_start - 8 - len(raw))
    total = data_start + offset
    os.ftruncate(fd, total)
    with mmap.mmap(fd, total) as out:
        out[:8] = struct.pack("<Q", len(raw))
        out[8:data_start] = raw
        files: dict[Path, mmap.mmap] = {}
        try:
            for t in shared:
                row_bytes = _nbytes(t.shape[1:], t.dtype)
                base = data_start + header[t.name]["data_offsets"][0]
                for p in t.parts:
                    file, begin, end, _, _ = index[p.checkpoint]
                    if file not in files:
                        with file.open("rb") as f:
                            files[file] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                    out[base + p.start * row_bytes: base + p.stop * row_bytes] = files[file][begin:end]
        finally:
            for m in files.values():
                m.close()
    return total


def open_segment(path: str | Path, fingerprint: str | None = None, writable: bool = False) -> Segment:
    """Maps a shared base read-only (``/proc/self/fd/N`` for an inherited memory file); SegmentError unless it
    is one, and (``fingerprint`` given) of that base model. ``writable``: for the aliasing tests only, which write
    through one side's names and read through the other's; no service maps it so."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as e:
        raise SegmentError(f"the shared base {path} cannot be opened ({e.strerror}): is this service started "
                           "by the launcher that holds it?") from None
    try:
        total = os.fstat(fd).st_size
        if total < 8:
            raise SegmentError(f"{path} is empty: not a shared base")
        buffer = mmap.mmap(fd, total, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)
    try:
        tensors, offsets, found = _parse(buffer, str(path), fingerprint)
    except SegmentError:
        buffer.close()
        raise
    return Segment(tensors, offsets, found, buffer, total)


def _parse(raw: Any, label: str, fingerprint: str | None) -> tuple[dict[str, SharedTensor], dict[str, int], str]:
    """The tensors of a shared base's header (``raw``: its first bytes, or all of them) and where each one's bytes
    start; SegmentError unless it is one, and (``fingerprint`` given) of that base model."""
    (size,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8:8 + size])
        meta = header.pop("__metadata__")
    except (ValueError, KeyError):
        raise SegmentError(f"{label} is not a shared base (no safetensors header with metadata)") from None
    if meta.get("format") != FORMAT:
        raise SegmentError(f"{label} is a {meta.get('format')!r} file, not a {FORMAT} shared base")
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise SegmentError(f"the shared base holds model {meta['fingerprint']}, this service's model is {fingerprint}")
    parts = json.loads(meta["parts"])
    data_start = 8 + size
    tensors, offsets = {}, {}
    for name, entry in header.items():
        tensors[name] = SharedTensor(name, tuple(entry["shape"]), entry["dtype"],
                                     tuple(Part(c, a, b) for c, a, b in parts[name]))
        offsets[name] = data_start + entry["data_offsets"][0]
    return tensors, offsets, meta["fingerprint"]


#: The handle file of a shared base in device memory: the header, and the platform's handle of its bytes.
DEVICE_FORMAT = "lorarl-shared-base-device-1"


def to_device(segment: Segment, device: str) -> Segment:
    """``segment``'s bytes copied once into one buffer on ``device``: a segment whose views are device tensors.
    The caller keeps it (and so the buffer) for as long as any process computes on it."""
    import torch

    buffer = torch.empty(segment.nbytes, dtype=torch.uint8, device=device)
    buffer.copy_(torch.frombuffer(segment.buffer, dtype=torch.uint8))
    return Segment(segment.tensors, segment.offsets, segment.fingerprint, segment.buffer, segment.nbytes, buffer)


def write_device_handle(segment: Segment, path: str | Path) -> Path:
    """Writes the handle file by which another process on the same device opens ``segment`` (a to_device one):
    JSON, the header in base64 and the buffer's CUDA IPC handle (lorarl.platform.cuda_ipc)."""
    import base64

    from lorarl.platform.cuda_ipc import export_buffer

    path = Path(path)
    path.write_text(json.dumps({"format": DEVICE_FORMAT, "header": base64.b64encode(segment.header()).decode(),
                                "nbytes": segment.nbytes, "buffer": export_buffer(segment.device_buffer)}))
    return path


def open_device_segment(path: str | Path, fingerprint: str | None = None) -> Segment:
    """The shared base a handle file names (write_device_handle), over the same device memory; SegmentError for
    a file that is not such a handle, or of another model."""
    import base64

    from lorarl.platform.cuda_ipc import open_buffer

    try:
        handle = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SegmentError(f"the shared base handle {path} cannot be read ({e})") from None
    if not isinstance(handle, dict) or handle.get("format") != DEVICE_FORMAT:
        raise SegmentError(f"{path} is not a {DEVICE_FORMAT} handle")
    tensors, offsets, found = _parse(base64.b64decode(handle["header"]), str(path), fingerprint)
    return Segment(tensors, offsets, found, None, handle["nbytes"], open_buffer(handle["buffer"]))


def open_shared_base(path: str | Path, fingerprint: str | None = None) -> Segment:
    """A shared base by what the launcher gave: a device handle file (``*.json``) or the host memory file."""
    return open_device_segment(path, fingerprint) if str(path).endswith(".json") else open_segment(path, fingerprint)
