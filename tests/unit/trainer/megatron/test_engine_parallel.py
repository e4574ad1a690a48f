"""MegatronEngine at TP=2 (two gloo processes) computes what TP=1 computes: logprobs, metrics and adapters
after two steps (dense, and MoE with expert TP), the same PEFT export, and a checkpoint TP=1 can resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorarl.assets import DENSE_MODEL_DIR, MOE_MODEL_DIR
from lorarl.trainer.engines.api import MegatronSpec, TrainingSpec
from lorarl.trainer.engines.megatron.engine import MegatronEngine
from tests.support.workers import run_workers
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.fp64 import fp64_logprobs, max_diff, spread_bound

MODELS = {"dense": DENSE_MODEL_DIR, "moe": MOE_MODEL_DIR}
KEYS = ("loss", "pg_loss", "entropy", "grad_norm", "clip_fraction")


def spec(path: Path, tp: int) -> TrainingSpec:
    # Adam's eps above fp32 rounding of the gradients: with a tiny eps, Adam's first step is lr * sign(g), so
    # a gradient that is 0 up to rounding (summed in another order under TP) could move a weight by 2 * lr.
    return make_spec(path, engine="megatron", lr=0.1, micro_batch_tokens=24, optimizer={"eps": 1e-4},
                     megatron=MegatronSpec(tensor_parallel_size=tp))


def start(engine: MegatronEngine) -> None:
    """The same non-zero full adapters whatever the layout (B != 0, so every gradient path is exercised)."""
    g = torch.Generator().manual_seed(5)
    shapes = engine._checkpoint_shapes()
    engine.lora.load_full({n: torch.randn(shapes[n], generator=g) * 0.05 for n in sorted(shapes)})


def run(engine: MegatronEngine, out: Path, which: str) -> None:
    """Logprobs, two train steps, the gathered adapters, the PEFT export and a checkpoint, into ``out``."""
    start(engine)
    batch = synthetic_batch(3, vocab=250)
    result = {"logprobs": engine.compute_logprobs(batch), "reference": engine.compute_logprobs(batch, reference=True)}
    if torch.distributed.get_world_size() == 1:  # the exact values the fp32 layouts are measured against
        result["logprobs64"] = fp64_logprobs(engine, batch)
        result["reference64"] = fp64_logprobs(engine, batch, reference=True)
    steps = [engine.train_step(synthetic_batch(seed, vocab=250)) for seed in (1, 2)]
    result["metrics"] = [{k: m[k] for k in KEYS} for m in steps]
    adapters = engine.lora.full_tensors()
    peft = dict(engine.iter_adapter_tensors())
    engine.save_checkpoint(out / f"{which}-ckpt")
    if engine.rank == 0:
        (out / f"{which}.json").write_text(json.dumps(result))
        save_file({k: v.contiguous() for k, v in adapters.items()}, str(out / f"{which}-adapters.safetensors"))
        save_file({k: v.contiguous() for k, v in peft.items()}, str(out / f"{which}-peft.safetensors"))


def tp2_worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel, teardown

    torch.set_num_threads(1)
    init_parallel(ParallelSettings(tp=world_size), "cpu", rank=rank, world_size=world_size, init_method=init_method,
                  timeout_s=90)
    try:
        for which, path in MODELS.items():
            engine = MegatronEngine(spec(path, tp=world_size))
            qkv = next(ad for ad in engine.lora.adapters if ad.spec.name.endswith("linear_qkv"))
            assert qkv.lora_b.shape[0] * world_size == qkv.spec.out_features  # really sharded
            run(engine, Path(out_dir), which)
    finally:
        teardown()


@pytest.fixture(scope="module")
def tp2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp2")
    run_workers(tp2_worker, 2, (str(out),), timeout_s=180)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_tp2_trains_exactly_what_tp1_trains(which: str, tp2_dir: Path, tmp_path: Path) -> None:
    engine = MegatronEngine(spec(MODELS[which], tp=1))
    run(engine, tmp_path, which)
    one, two = (json.loads((d / f"{which}.json").read_text()) for d in (tmp_path, tp2_dir))
    for key in ("logprobs", "reference"):
        bound = spread_bound(one[key], one[f"{key}64"])  # from TP=1's own fp32 error, measured against fp64
        diff = max_diff(one[key], two[key])
        print(f"{which} {key}: |TP2 - TP1| {diff:.2e}, |TP1 - fp64| {max_diff(one[key], one[key + '64']):.2e}, "
              f"bound {bound:.2e}")
        assert diff <= bound, (key, diff, bound)
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        for key in KEYS:
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    for suffix in ("adapters", "peft"):
        a, b = (load_file(d / f"{which}-{suffix}.safetensors") for d in (tmp_path, tp2_dir))
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
    moved = load_file(tmp_path / f"{which}-adapters.safetensors")
    start(engine)  # back to the initial adapters: the two steps really changed them
    assert max((moved[n] - p).abs().max().item() for n, p in engine.lora.full_tensors().items()) > 1e-3
    resumed = MegatronEngine(spec(MODELS[which], tp=1))
    resumed.load_checkpoint(tp2_dir / f"{which}-ckpt")  # TP=2's checkpoint holds full tensors
    assert resumed.version == 2
    for name, tensor in resumed.lora.full_tensors().items():
        torch.testing.assert_close(tensor, moved[name], rtol=1e-4, atol=1e-5, msg=name)
