"""The torch engine's layer split (lorarl.trainer.engines.torch.layer_split): the stage sizes are the best
contiguous split, inputs follow each layer to its device, and a split engine trains, scores, merges and
checkpoints what a one-device engine does. On CPU every "device" is the CPU, so the hooks run but move
nothing; across real accelerators the split is UNTESTED here (no multi-device machine was lent)."""

from __future__ import annotations

import itertools
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from lorarl.common.errors import InvalidArgumentError
from lorarl.trainer.engines.api import MemorySpec, TrainingSpec
from lorarl.trainer.engines.memory import stage_sizes
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.engines.torch.layer_split import split_devices, to_device
from lorarl.trainer.ranks.rank_engines import check_job_fits
from lorarl.trainer.service.convert import job_config, job_spec
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch


def best_split(outside: float, per_layer: list[float], stages: int) -> float:
    """The smallest largest-device load over every contiguous split (exhaustive)."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(per_layer)), stages - 1):
        bounds = (0, *cuts, len(per_layer))
        loads = [sum(per_layer[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += outside
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_stage_sizes_is_the_best_contiguous_split(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    layers = int(torch.randint(2, 9, (1,), generator=gen))
    stages = int(torch.randint(1, layers + 1, (1,), generator=gen))
    per_layer = (torch.rand(layers, generator=gen) * 10 + 1).tolist()
    outside = float(torch.rand(1, generator=gen) * 15)
    sizes = stage_sizes(outside, per_layer, stages)
    assert len(sizes) == stages and sum(sizes) == layers and min(sizes) >= 1
    bounds = [0, *itertools.accumulate(sizes)]
    loads = [sum(per_layer[a:b]) for a, b in itertools.pairwise(bounds)]
    loads[0] += outside
    assert max(loads) == pytest.approx(best_split(outside, per_layer, stages), rel=1e-5)


def test_stage_sizes_refuses_more_devices_than_layers() -> None:
    assert stage_sizes(0.0, [1.0] * 48, 2) == [24, 24]
    assert stage_sizes(1.0, [1.0] * 48, 2) == [24, 24]  # 25/24 either way: the first keeps its half
    with pytest.raises(ValueError, match="cannot split 3 decoder layers across 4 devices"):
        stage_sizes(0.0, [1.0] * 3, 4)


def test_devices_count_from_the_named_index_and_inputs_follow_nested() -> None:
    assert split_devices("cuda:2", 3) == [torch.device("cuda:2"), torch.device("cuda:3"), torch.device("cuda:4")]
    assert split_devices("cuda", 2) == [torch.device("cuda:0"), torch.device("cuda:1")]  # npu: needs torch_npu
    assert split_devices("cpu", 2) == [torch.device("cpu")] * 2
    Pair = namedtuple("Pair", "cos sin")
    moved = to_device((torch.ones(2), {"mask": torch.zeros(1), "n": 3}, [Pair(torch.ones(1), torch.ones(1))], None),
                      torch.device("meta"))
    assert moved[0].is_meta and moved[1]["mask"].is_meta and moved[1]["n"] == 3 and moved[3] is None
    assert isinstance(moved[2][0], Pair) and moved[2][0].cos.is_meta and moved[2][0].sin.is_meta


@pytest.mark.parametrize(("kind", "checkpointing"), [("dense", "off"), ("moe", "on")])
def test_a_split_engine_trains_what_one_device_trains(kind: str, checkpointing: str, dense_dir: Path,
                                                      moe_dir: Path) -> None:
    path = dense_dir if kind == "dense" else moe_dir
    memory = MemorySpec(activation_checkpointing=checkpointing)
    engines = [TorchEngine(make_spec(path, device="cpu", memory=memory, layer_devices=n)) for n in (1, 2)]
    whole, split = engines
    layers = whole.model.config.num_hidden_layers
    assert whole.layers_per_device == [layers] and sum(split.layers_per_device) == layers
    assert len(split.layers_per_device) == 2 and min(split.layers_per_device) >= 1
    decoder = split.model.get_decoder()
    assert all(layer._forward_pre_hooks for layer in decoder.layers) and decoder.norm._forward_pre_hooks
    assert not any(layer._forward_pre_hooks for layer in whole.model.get_decoder().layers)
    for step in range(2):
        batch = synthetic_batch(step, vocab=whole.vocab_size, version=step)
        got = [(e.train_step(batch), e.compute_logprobs(batch)) for e in engines]
        metrics = [{k: v for k, v in m.items() if not k.endswith("time_s")} for m, _ in got]
        assert metrics[0]["loss"] != 0 and metrics[0]["grad_norm"] > 0
        assert metrics[0] == pytest.approx(metrics[1], rel=1e-6, abs=1e-7)
        for a, b in zip(got[0][1], got[1][1], strict=True):
            assert a == pytest.approx(b, abs=1e-6)
    merged = [dict(e.iter_merged_tensors()) for e in engines]
    assert merged[0].keys() == merged[1].keys()
    for name, tensor in merged[0].items():
        torch.testing.assert_close(merged[1][name], tensor, rtol=0, atol=0)


def test_a_split_is_checked_against_the_engine_the_ranks_and_the_devices(dense_dir: Path) -> None:
    with pytest.raises(ValueError, match="layer_devices splits the torch engine's layers"):
        TrainingSpec(base_model_path="m", engine="megatron", layer_devices=2)
    with pytest.raises(ValueError, match=r"layer_devices must be 1\.\.64"):
        TrainingSpec(base_model_path="m", layer_devices=0)
    spec = make_spec(dense_dir, device="cpu", layer_devices=2)
    assert job_spec(job_config(spec), "cpu").layer_devices == 2  # the proto field round-trips; 0 means 1
    proto = job_config(spec)
    proto.layer_devices = 0
    assert job_spec(proto, "cpu").layer_devices == 1
    field, problem = check_job_fits(spec, 2, "cpu")
    assert field == "config.layer_devices" and "one-rank trainer" in problem
    assert check_job_fits(spec, 1, "cpu") is None
    proto.engine, proto.layer_devices = "megatron", 2
    with pytest.raises(InvalidArgumentError, match="splits the torch engine's layers") as raised:
        job_spec(proto, "cpu")
    assert raised.value.field == "config.layer_devices"
