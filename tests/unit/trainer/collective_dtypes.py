"""Records the dtype of every tensor the trainer hands a torch.distributed collective.

HCCL has no float64 collectives; the multi-rank tests run their steps under `recorded_dtypes` and
assert that none of the trainer's collectives carried float64 (and that the recorder saw traffic).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

#: Not the point-to-point ops: torch.distributed.P2POp checks them by identity (pipeline stages send
#: activations, in the model's dtype, through them).
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


@contextlib.contextmanager
def recorded_dtypes() -> Iterator[set[str]]:
    seen: set[str] = set()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def recording(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for value in (*args, *kwargs.values()):
                seen.update(str(t.dtype) for t in _tensors(value))
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, recording(fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def assert_no_float64(seen: set[str]) -> None:
    assert {"torch.int64", "torch.float32"} <= seen, seen  # the recorder saw the counts and the metrics
    assert "torch.float64" not in seen, f"a collective carried float64 (HCCL cannot): {sorted(seen)}"
