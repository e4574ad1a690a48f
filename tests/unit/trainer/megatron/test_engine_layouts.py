"""MegatronEngine under data, expert and pipeline parallelism (two gloo processes) trains exactly what one
process trains on the same full batches: logprobs, metrics (incl. an empty data-parallel share and a step
that lowers the loss), gathered adapters, PEFT and merged exports; one process resumes the two-rank checkpoint.

Every rank is handed the same full batch; layouts: DP=2 (dense, and MoE with experts replicated over
DP), EP=2 on the MoE model (per-expert and shared expert adapters) and PP=2 on the dense model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorarl.assets import DENSE_MODEL_DIR, MOE_MODEL_DIR
from lorarl.trainer.engines.api import MegatronSpec, TrainingSpec, TrajectoryRecord
from lorarl.trainer.engines.megatron.engine import MegatronEngine
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.rl.losses import LossSpec
from tests.support.workers import run_workers
from tests.unit.trainer.collective_dtypes import assert_no_float64, recorded_dtypes
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.fp64 import fp64_logprobs, max_diff, spread_bound

VOCAB = 250
KEYS = ("loss", "pg_loss", "entropy", "kl", "grad_norm", "clip_fraction", "tokens", "sequences")
TOLERANCE = 1e-5
# name -> (model, expert_mode, (tp, pp, ep) on two ranks)
CASES = {
    "dp2-dense": (DENSE_MODEL_DIR, "per_expert", (1, 1, 1)),
    "dp2-moe": (MOE_MODEL_DIR, "per_expert", (1, 1, 1)),
    "ep2-per_expert": (MOE_MODEL_DIR, "per_expert", (1, 1, 2)),
    "ep2-shared": (MOE_MODEL_DIR, "shared", (1, 1, 2)),
    "pp2-dense": (DENSE_MODEL_DIR, "per_expert", (1, 2, 1)),
}


def spec(name: str, sizes: tuple[int, int, int] = (1, 1, 1)) -> TrainingSpec:
    # Every kind of forward pass (proximal, reference, with grad) and uneven micro-batch counts per DP rank.
    # Adam's eps above fp32 rounding of the gradients (a gradient 0 up to rounding could otherwise move a
    # weight by lr: Adam's first step is lr * sign(g)).
    model, expert_mode, (tp, pp, ep) = CASES[name][0], CASES[name][1], sizes
    return make_spec(model, engine="megatron", lr=1e-3, micro_batch_tokens=24, optimizer={"eps": 1e-4},
                     loss=LossSpec(type="grpo", kl_coef=0.05, entropy_coef=0.01), recompute_proximal=True,
                     lora=LoraConfig(rank=4, alpha=8, expert_mode=expert_mode),
                     megatron=MegatronSpec(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                               expert_parallel_size=ep))


def start(engine: MegatronEngine) -> None:
    """The same non-zero full adapters whatever the layout (B != 0, so every gradient path is exercised)."""
    g = torch.Generator().manual_seed(5)
    shapes = engine._checkpoint_shapes()
    engine.lora.load_full({n: torch.randn(shapes[n], generator=g) * 0.05 for n in sorted(shapes)})


def on_policy(engine: MegatronEngine, records: list[TrajectoryRecord]) -> list[TrajectoryRecord]:
    for rec, lp in zip(records, engine.compute_logprobs(records), strict=True):
        rec.behavior_logprobs, rec.token_versions = lp, [engine.version] * len(lp)
    return records


def fixed_batch() -> list[TrajectoryRecord]:
    """Two prompts, a rewarded and an unrewarded completion each (one group per data-parallel rank)."""
    out = []
    for g, prompt in enumerate(([1, 5, 9], [2, 6])):
        out += [TrajectoryRecord(prompt, [10, 11, 12, 13], [], [], 1.0, f"f{g}"),
                TrajectoryRecord(prompt, [20, 21, 22], [], [], 0.0, f"f{g}")]
    return out


def run_after_checkpoint(engine: MegatronEngine) -> list[dict[str, float]]:
    """A one-group batch (an empty share on the second DP rank), then the same on-policy batch twice."""
    steps = [engine.train_step(synthetic_batch(4, groups=1, vocab=VOCAB))]
    fixed = on_policy(engine, fixed_batch())
    steps += [engine.train_step(fixed), engine.train_step(fixed)]
    return steps


def run(engine: MegatronEngine, out: Path, name: str) -> None:
    """Logprobs, five steps around a checkpoint, the gathered adapters, PEFT and merged weights, into ``out``."""
    start(engine)
    probe = synthetic_batch(3, vocab=VOCAB)
    result = {"logprobs": engine.compute_logprobs(probe), "reference": engine.compute_logprobs(probe, reference=True)}
    if torch.distributed.get_world_size() == 1:  # the exact values the fp32 layouts are measured against
        result["logprobs64"] = fp64_logprobs(engine, probe)
        result["reference64"] = fp64_logprobs(engine, probe, reference=True)
    steps = [engine.train_step(synthetic_batch(seed, vocab=VOCAB)) for seed in (1, 2)]
    engine.save_checkpoint(out / f"{name}-ckpt")
    steps += run_after_checkpoint(engine)
    result["metrics"] = [{k: m.get(k, 0.0) for k in KEYS} for m in steps]
    adapters = engine.lora.full_tensors()
    peft = dict(engine.iter_adapter_tensors())
    merged = dict(engine.iter_merged_tensors())
    if engine.rank == 0:
        (out / f"{name}.json").write_text(json.dumps(result))
        save_file({k: v.contiguous() for k, v in adapters.items()}, str(out / f"{name}-adapters.safetensors"))
        save_file({k: v.contiguous() for k, v in peft.items()}, str(out / f"{name}-peft.safetensors"))
        save_file({k: v.contiguous() for k, v in merged.items()}, str(out / f"{name}-merged.safetensors"))


def count_idle(engine: MegatronEngine) -> list[int]:
    """Records every idle micro-step count the engine decides (see GradientReducer.idle_micro_steps)."""
    counts: list[int] = []
    decide = engine.rl.reducer.idle_micro_steps

    def counted(planned: int) -> int:
        counts.append(decide(planned))
        return counts[-1]

    engine.rl.reducer.idle_micro_steps = counted  # type: ignore[method-assign]
    return counts


def layout_worker(rank: int, world_size: int, init_method: str, names: list[str], out_dir: str) -> None:
    from lorarl.trainer.engines.megatron.parallel import ParallelSettings, init_parallel, teardown

    torch.set_num_threads(1)
    tp, pp, ep = CASES[names[0]][2]
    init_parallel(ParallelSettings(tp=tp, pp=pp, ep=ep), "cpu", rank=rank, world_size=world_size,
                  init_method=init_method, timeout_s=90)
    try:
        for name in names:
            engine = MegatronEngine(spec(name, CASES[name][2]))
            split = pp > 1 or (ep > 1 and CASES[name][1] == "per_expert")  # adapters really split over ranks
            assert (len(engine.named_trainable_parameters()) < len(engine._checkpoint_shapes())) == split
            idle = count_idle(engine)
            with recorded_dtypes() as seen:
                run(engine, Path(out_dir), name)
            assert_no_float64(seen)
            total = torch.tensor(float(sum(idle)))
            torch.distributed.all_reduce(total)
            assert (total.item() > 0) == (ep > 1)  # expert parallelism really ran idle lockstep micro-steps
        with pytest.raises(ValueError, match="same full batch"):  # a caller that shards itself is refused
            engine.compute_logprobs(synthetic_batch(1, groups=1 + rank, vocab=VOCAB))
    finally:
        teardown()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each layout's results; the worlds are started lazily, once per layout."""
    started: dict[tuple[int, int, int], Path] = {}

    def get(name: str) -> Path:
        sizes = CASES[name][2]
        if sizes not in started:
            out = tmp_path_factory.mktemp("layout")
            run_workers(layout_worker, 2, ([n for n in CASES if CASES[n][2] == sizes], str(out)), timeout_s=240)
            started[sizes] = out
        return started[sizes]

    return get


def metric_diff(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
    """The largest difference of any metric, relative to its size where that is above 1."""
    return max(abs(x[k] - y[k]) / max(1.0, abs(x[k])) for x, y in zip(a, b, strict=True) for k in KEYS)


def tensor_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_train_exactly_what_one_process_trains(name: str, two_ranks: Callable[[str], Path],
                                                         tmp_path: Path) -> None:
    two = two_ranks(name)
    engine = MegatronEngine(spec(name))
    run(engine, tmp_path, name)
    one_r, two_r = (json.loads((d / f"{name}.json").read_text()) for d in (tmp_path, two))
    for key in ("logprobs", "reference"):  # held to the bound from one process's measured fp32 error
        bound = spread_bound(one_r[key], one_r[f"{key}64"])
        assert max_diff(one_r[key], two_r[key]) <= bound, (key, max_diff(one_r[key], two_r[key]), bound)
    diffs = {"metrics": metric_diff(one_r["metrics"], two_r["metrics"])}
    for suffix in ("adapters", "peft", "merged"):
        diffs[suffix] = tensor_diff(*(load_file(d / f"{name}-{suffix}.safetensors") for d in (tmp_path, two)))
    print(f"{name}: max |one process - two ranks| {diffs}")
    assert max(diffs.values()) <= TOLERANCE, diffs
    losses = [m["loss"] for m in one_r["metrics"]]
    assert losses[-1] < losses[-2] - 1e-3, losses  # the repeated on-policy batch: the step lowered the loss
    assert one_r["metrics"][2]["sequences"] == 3  # the one-group step really left a DP rank without data
    moved = load_file(tmp_path / f"{name}-adapters.safetensors")
    start(engine)  # back to the initial adapters: the steps really changed them (so the comparison can fail)
    assert max((moved[n] - p).abs().max().item() for n, p in engine.lora.full_tensors().items()) > 2e-3

    resumed = MegatronEngine(spec(name))  # one process resumes the two-rank checkpoint (full tensors)
    assert resumed.load_checkpoint(two / f"{name}-ckpt").step == 2
    after = [{k: m.get(k, 0.0) for k in KEYS} for m in run_after_checkpoint(resumed)]
    assert metric_diff(after, one_r["metrics"][2:]) <= TOLERANCE
    assert tensor_diff(resumed.lora.full_tensors(), moved) <= TOLERANCE
