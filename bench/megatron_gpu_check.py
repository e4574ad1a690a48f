"""Megatron engine check on one device: parity with the torch engine, learning, export, and step time.

One prepared script for a GPU session (about 2-4 minutes on one H200), also runnable on CPU with
small sizes (``--device cpu --quick``, what the unit test runs) so it never rots:

1. parity: MegatronEngine (TP=1) and TorchEngine given the same adapter (the Megatron PEFT export
   loaded into the torch engine) give the same completion logprobs, policy and reference, on the
   shipped tiny dense and MoE models (fp32, TF32 off) -> max |diff| <= 1e-4;
2. learning: two GRPO steps on a fixed on-policy batch -> the second step's loss is lower;
3. export: the PEFT adapter in transformers + PEFT gives the engine's logits (dense and MoE);
4. step time: one train_step of each engine on a random-init Qwen3-0.6B-shaped model (``--layers``,
   bf16 on CUDA), best of ``--steps`` after a warmup step -> megatron / torch ratio.

CUDA runs use nccl with world size 1 (the engine initialises its own process group).

    python bench/megatron_gpu_check.py --device cuda
    python bench/megatron_gpu_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = 1e-4
IDS = [[257, 10, 55, 43, 52, 258, 10, 9], [257, 40, 41, 42, 43, 44, 45, 46]]


def batch(seed: int, vocab: int, groups: int = 3, group_size: int = 3, prompt: int = 6, completion: int = 8) -> list:
    from lorarl.trainer.engines.api import TrajectoryRecord

    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(groups):
        p = torch.randint(1, vocab, (prompt,), generator=g).tolist()
        for _ in range(group_size):
            c = torch.randint(1, vocab, (completion,), generator=g).tolist()
            out.append(TrajectoryRecord(p, c, [-2.0] * completion, [0] * completion,
                                        float(torch.randint(0, 3, (), generator=g)), f"g{seed}-{group}"))
    return out


def spec(path: Path, engine: str, device: str, dtype: str = "float32", lr: float = 1e-2, **kw: object):
    from lorarl.trainer.engines.api import OptimizerSpec, TrainingSpec
    from lorarl.trainer.rl.lora import LoraConfig

    return TrainingSpec(base_model_path=str(path), engine=engine, device=device, dtype=dtype,
                   lora=LoraConfig(rank=8, alpha=16, **kw), optimizer=OptimizerSpec(learning_rate=lr))


def randomize(engine, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in engine.named_trainable_parameters().values():
            p.copy_((torch.randn(p.shape, generator=g) * std).to(p.device))


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def check_parity(models: dict[str, Path], device: str) -> dict[str, float]:
    from lorarl.trainer.engines.megatron.engine import MegatronEngine
    from lorarl.trainer.engines.torch.engine import TorchEngine
    from lorarl.trainer.rl.lora import load_peft_state_dict

    out = {}
    for which, path in models.items():
        mega = MegatronEngine(spec(path, "megatron", device))
        randomize(mega)
        ref = TorchEngine(spec(path, "torch", device))
        load_peft_state_dict(ref.model, {k: v.to(ref.device) for k, v in mega.iter_adapter_tensors()})
        records = batch(1, mega.vocab_size)
        out[f"parity {which} policy"] = max_diff(mega.compute_logprobs(records), ref.compute_logprobs(records))
        out[f"parity {which} reference"] = max_diff(mega.compute_logprobs(records, reference=True),
                                                    ref.compute_logprobs(records, reference=True))
    return out


def check_learning(path: Path, device: str) -> tuple[float, float]:
    from lorarl.trainer.engines.api import TrajectoryRecord
    from lorarl.trainer.engines.megatron.engine import MegatronEngine

    engine = MegatronEngine(spec(path, "megatron", device, lr=2e-3))
    records = [TrajectoryRecord([1, 5, 9], [10, 11, 12, 13], [], [0] * 4, 1.0, "g"),
               TrajectoryRecord([1, 5, 9], [20, 21, 22, 23], [], [0] * 4, 0.0, "g")]
    for rec, lp in zip(records, engine.compute_logprobs(records), strict=True):
        rec.behavior_logprobs = lp  # on-policy: the first loss is 0, an update must push it below
    return engine.train_step(records)["loss"], engine.train_step(records)["loss"]


def check_export(models: dict[str, Path], device: str, tmp: Path) -> dict[str, float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorarl.trainer.engines.megatron.engine import MegatronEngine
    from lorarl.trainer.engines.megatron.model import compute_logits

    out = {}
    ids = torch.tensor(IDS, device=device)
    for which, path in models.items():
        engine = MegatronEngine(spec(path, "megatron", device))
        randomize(engine)
        adapter = engine.export_adapter(tmp / f"{which}-adapter")
        with torch.no_grad():
            mine = compute_logits(engine.model, ids, engine.vocab_size).float()
            base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
            peft_logits = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits.float()
        out[f"export {which} PEFT logits"] = float((mine - peft_logits).abs().max())
    return out


def best_step_time(make: Callable[[], object], records: list, steps: int, device: str) -> float:
    engine = make()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    engine.train_step(records)  # warmup
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.train_step(records)
        sync()
        times.append(time.perf_counter() - start)
    del engine
    return min(times)


def step_times(path: Path, device: str, dtype: str, steps: int, tokens: tuple[int, int]) -> dict[str, float]:
    from lorarl.trainer.engines.megatron.engine import MegatronEngine
    from lorarl.trainer.engines.torch.engine import TorchEngine

    vocab = 250
    records = batch(4, vocab, groups=2, group_size=4, prompt=tokens[0], completion=tokens[1])
    torch_s = best_step_time(lambda: TorchEngine(spec(path, "torch", device, dtype)), records, steps, device)
    mega_s = best_step_time(lambda: MegatronEngine(spec(path, "megatron", device, dtype)), records, steps, device)
    return {"torch step s": torch_s, "megatron step s": mega_s, "megatron / torch": mega_s / torch_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny step-time model (the CPU smoke run)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-0.6B-shaped timing model")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per engine (after one warmup)")
    args = parser.parse_args(argv)
    from lorarl.assets import DENSE_MODEL_DIR, MOE_MODEL_DIR

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # parity is checked in true fp32
        torch.backends.cudnn.allow_tf32 = False
    models = {"dense": DENSE_MODEL_DIR, "moe": MOE_MODEL_DIR}
    results: list[tuple[str, str, bool | None]] = []
    start = time.perf_counter()
    for name, diff in check_parity(models, args.device).items():
        results.append((name, f"max |diff| {diff:.2e}", diff <= TOLERANCE))
    first, second = check_learning(DENSE_MODEL_DIR, args.device)
    results.append(("learning: 2nd step loss < 1st", f"{first:.4f} -> {second:.4f}", second < first))
    with tempfile.TemporaryDirectory() as tmp:
        for name, diff in check_export(models, args.device, Path(tmp)).items():
            results.append((name, f"max |diff| {diff:.2e}", diff <= TOLERANCE))
        if args.quick:
            timing_model, dtype, tokens = DENSE_MODEL_DIR, "float32", (8, 8)
        else:
            from lorarl.assets.models import build_random_model

            timing_model = Path(tmp) / "qwen3-0.6b"
            build_random_model("qwen3-0.6b", timing_model, num_layers=args.layers, seed=0, dtype=torch.bfloat16)
            dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
            tokens = (128, 128)
        timing = step_times(timing_model, args.device, dtype, 1 if args.quick else args.steps, tokens)
    results.append(("step time (best)", f"torch {timing['torch step s']:.3f} s, megatron "
                    f"{timing['megatron step s']:.3f} s, ratio {timing['megatron / torch']:.2f}", None))
    print(f"\nmegatron engine check on {args.device} ({time.perf_counter() - start:.0f} s)")
    for name, value, ok in results:
        print(f"  {'PASS' if ok else 'FAIL' if ok is not None else 'INFO'}  {name}: {value}")
    return 0 if all(ok is not False for _, _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
