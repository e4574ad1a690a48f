"""Two CPU processes over gloo train the same adapters as one process on the full batch, with no
float64 in any collective (HCCL has none)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from lorarl.trainer.engines.distributed import init_distributed, shard_by_group
from lorarl.trainer.engines.torch.data_parallel import DataParallelEngine
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.losses import LossSpec
from tests.support.workers import run_workers
from tests.unit.trainer.collective_dtypes import assert_no_float64, recorded_dtypes
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.tiny import dense_model

STEPS = 3
LOSSES = {
    "grpo": LossSpec(type="grpo"),  # per-sequence shares across ranks
    "dapo": LossSpec(type="dapo", clip_eps_high=0.28),  # per-token shares across ranks
}


def batches() -> list[list]:
    # Five groups: ranks get 3 and 2 groups, so token and sequence counts differ between them.
    return [synthetic_batch(step, groups=5, group_size=3) for step in range(STEPS)]


def spec_for(model_dir: Path, loss: LossSpec):
    return make_spec(model_dir, lr=1e-2, micro_batch_tokens=24, loss=loss)


def worker(rank: int, world_size: int, init_method: str, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed("cpu", rank, world_size, init_method, timeout_s=120)
    try:
        for name, loss in LOSSES.items():
            engine = DataParallelEngine(spec_for(Path(model_dir), loss))
            with recorded_dtypes() as seen:
                losses = [engine.train_step(shard_by_group(b, rank, world_size))["loss"] for b in batches()]
            assert_no_float64(seen)
            tensors = {n: p.detach().contiguous() for n, p in engine.named_trainable_parameters().items()}
            save_file(tensors, f"{out_dir}/{name}-rank{rank}.safetensors")
            Path(f"{out_dir}/{name}-rank{rank}.json").write_text(json.dumps(losses))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_match_one_process_on_the_full_batch(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    dense_model().save_pretrained(model_dir)
    run_workers(worker, 2, (str(model_dir), str(tmp_path)), timeout_s=180)

    for name, loss in LOSSES.items():
        single = TorchEngine(spec_for(model_dir, loss))
        single_losses = [single.train_step(b)["loss"] for b in batches()]
        expected = {n: p.detach() for n, p in single.named_trainable_parameters().items()}
        rank0 = load_file(tmp_path / f"{name}-rank0.safetensors")
        rank1 = load_file(tmp_path / f"{name}-rank1.safetensors")
        assert rank0.keys() == rank1.keys() == expected.keys()
        for n in expected:
            assert torch.equal(rank0[n], rank1[n]), f"{name}: ranks diverged on {n}"
            torch.testing.assert_close(rank0[n], expected[n], rtol=0, atol=1e-5, msg=f"{name}: {n}")
        assert any(t.abs().max() > 1e-3 for n, t in rank0.items() if "lora_b" in n)  # adapters moved
        for rank in (0, 1):
            losses = json.loads((tmp_path / f"{name}-rank{rank}.json").read_text())
            assert losses == pytest.approx(single_losses, abs=1e-5)
