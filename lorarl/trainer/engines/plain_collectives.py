"""Broadcast and all-gather of plain data between trainer ranks, without pickle.

torch's ``broadcast_object_list`` / ``all_gather_object`` pickle whatever they carry, and unpickling
runs code: no pickle crosses a wire here. Numbers, strings, lists, tuples and dicts travel as JSON
(tagged so that int keys and tuples come back as they went; Python's JSON round-trips every float,
NaN and inf included); tensors travel as safetensors bytes. Either way the bytes move as one uint8
tensor on the group's own device (CPU for gloo, the current GPU for nccl, the NPU for hccl).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

ORDER_KEY = "lorarl.order"  # safetensors metadata: the names in the order they were given


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":  # Ascend; untested here
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


# ------------------------------------------------------------------ plain data as JSON


def _encode(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {"d": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"t": [_encode(x) for x in obj]}
    if isinstance(obj, list):
        return {"l": [_encode(x) for x in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot send a {type(obj).__name__} between ranks as plain data")


def _decode(obj: Any) -> Any:
    if not isinstance(obj, dict):
        return obj
    ((tag, items),) = obj.items()
    if tag == "d":
        return {_decode(k): _decode(v) for k, v in items}
    if tag == "t":
        return tuple(_decode(x) for x in items)
    return [_decode(x) for x in items]


def to_bytes(obj: Any) -> bytes:
    return json.dumps(_encode(obj), separators=(",", ":")).encode()


def from_bytes(data: bytes) -> Any:
    return _decode(json.loads(data))


# ------------------------------------------------------------------ bytes over a group


def _as_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)


def broadcast_bytes(data: bytes | None, src: int, group: dist.ProcessGroup | None = None) -> bytes:
    """``data`` of global rank ``src`` on every rank of ``group``."""
    device = group_device(group)
    mine = dist.get_rank() == src
    size = torch.tensor([len(data) if mine and data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buffer = _as_tensor(data, device) if mine and data is not None else \
        torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return bytes(buffer.cpu().numpy()) if not mine else (data or b"")


def all_gather_bytes(data: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's ``data``, in group rank order."""
    device = group_device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(data)] = _as_tensor(data, device)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [bytes(part[:n].cpu().numpy()) for part, n in zip(parts, lengths, strict=True)]


# ------------------------------------------------------------------ what the engines send


def broadcast_plain(obj: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """``obj`` (JSON-able plain data, see module docstring) of global rank ``src`` on every rank."""
    return from_bytes(broadcast_bytes(to_bytes(obj) if dist.get_rank() == src else None, src, group))


def all_gather_plain(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    return [from_bytes(part) for part in all_gather_bytes(to_bytes(obj), group)]


def tensors_to_bytes(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """Named CPU tensors as safetensors bytes, their order kept in the metadata."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in named}
    if len(tensors) != len(named):
        raise ValueError("tensor names must be unique")
    return save_tensors(tensors, metadata={ORDER_KEY: json.dumps([name for name, _ in named])})


def tensors_from_bytes(data: bytes) -> list[tuple[str, torch.Tensor]]:
    tensors = load_tensors(data)
    if not tensors:
        return []
    header_len = int.from_bytes(data[:8], "little")
    order = json.loads(json.loads(data[8: 8 + header_len])["__metadata__"][ORDER_KEY])
    return [(name, tensors[name]) for name in order]


def broadcast_tensors(named: list[tuple[str, torch.Tensor]] | None, src: int,
                      group: dist.ProcessGroup | None = None) -> list[tuple[str, torch.Tensor]] | None:
    """Rank ``src``'s named CPU tensors (or None, the end of a stream) on every rank."""
    mine = dist.get_rank() == src
    payload = (b"\x00" if named is None else b"\x01" + tensors_to_bytes(named)) if mine else None
    data = broadcast_bytes(payload, src, group)
    return None if data[:1] == b"\x00" else tensors_from_bytes(data[1:])


def all_gather_tensors(tensors: dict[str, torch.Tensor], group: dist.ProcessGroup | None = None
                       ) -> list[dict[str, torch.Tensor]]:
    """Every rank's named CPU tensors, in group rank order."""
    return [dict(tensors_from_bytes(part)) for part in all_gather_bytes(tensors_to_bytes(list(tensors.items())),
                                                                         group)]
