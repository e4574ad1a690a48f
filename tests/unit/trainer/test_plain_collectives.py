"""Object collectives without pickle between real gloo ranks: plain data keeps its int keys, tuples and
non-finite floats; tensors keep dtype, values and order; a None ends a stream."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from lorarl.trainer.engines.plain_collectives import (
    all_gather_plain,
    all_gather_tensors,
    broadcast_plain,
    broadcast_tensors,
    from_bytes,
    to_bytes,
)
from tests.support.workers import run_workers

PLAIN = {3: [0.1, -2.5e-300, 1e300], "shape": (8, 4), "none": None, "flag": True, "name": "ß"}


def test_plain_data_round_trips_through_json_bytes() -> None:
    assert from_bytes(to_bytes(PLAIN)) == PLAIN
    back = from_bytes(to_bytes({"x": [math.nan, math.inf]}))["x"]
    assert math.isnan(back[0]) and back[1] == math.inf
    assert isinstance(from_bytes(to_bytes(PLAIN))["shape"], tuple)
    with pytest.raises(TypeError, match="cannot send a Tensor"):
        to_bytes({"t": torch.zeros(1)})


def worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        out = Path(out_dir)
        plain = broadcast_plain(PLAIN if rank == 1 else {"wrong": 0}, src=1)
        gathered = all_gather_plain({rank: [rank * 1.5]})
        mine = [("z.weight", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)), ("a.bias", torch.tensor([7, 8]))]
        stream = [broadcast_tensors(mine if rank == 0 else None, src=0), broadcast_tensors(None, src=0)]
        stages = all_gather_tensors({f"rank{rank}": torch.full((2,), float(rank))})
        (out / f"{rank}.json").write_text(json.dumps({
            "plain_ok": plain == PLAIN and isinstance(plain["shape"], tuple) and 3 in plain,
            "gathered": [sorted(g.items()) for g in gathered],
            "names": [n for n, _ in stream[0]], "end": stream[1] is None,
            "stages": [sorted(s) for s in stages]}))
        save_file({n: t for n, t in stream[0]} | {k: v for s in stages for k, v in s.items()},
                  str(out / f"{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def test_ranks_exchange_plain_data_and_tensors_without_pickle(tmp_path: Path) -> None:
    run_workers(worker, 2, (str(tmp_path),), timeout_s=60)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["plain_ok"]
        assert got["gathered"] == [[[0, [0.0]]], [[1, [1.5]]]]
        assert got["names"] == ["z.weight", "a.bias"] and got["end"]  # the order given, then the end
        assert got["stages"] == [["rank0"], ["rank1"]]
        tensors = load_file(tmp_path / f"{rank}.safetensors")
        assert tensors["z.weight"].dtype == torch.bfloat16
        assert torch.equal(tensors["z.weight"], torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
        assert torch.equal(tensors["a.bias"], torch.tensor([7, 8]))
        assert torch.equal(tensors["rank1"], torch.ones(2))
