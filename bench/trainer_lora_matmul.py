"""Trainer benchmark: fp32 LoRA projections as one matmul with the merged weight vs the low-rank path.

Two TorchEngines on the shipped tiny dense Qwen3, identical but for ``LoRALinear.merged_matmul``:
"low rank" computes each adapted projection as x W^T + scale (x A^T) B^T (a shrink, an expand and an
add over the whole output), "merged" as x (W + scale B A)^T with its own backward
(lorarl/trainer/rl/lora.py: _MergedLoRAMatmul). They train on the demo-shaped batch of
bench/prefix_sharing.py (16 task prompts x 8 completions of 1-8 tokens, GRPO, rank-8 all-linear,
lr 2e-3), steps alternating in one process so machine load hits both alike; after warm-up steps the
best and median of the timed steps are reported with their ratio, and both engines' losses and
gradient norms for the first three steps (the same numbers up to float rounding).

    OMP_NUM_THREADS=1 .venv/bin/python bench/trainer_lora_matmul.py
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Trainer: merged-weight LoRA matmul"
VARIANTS = ("low rank", "merged")


def lora_engine(merged: bool):
    from bench.prefix_sharing import engine
    from lorarl.trainer.rl.lora import LoRALinear

    e = engine("packed", 0)
    for module in e.model.modules():
        if isinstance(module, LoRALinear):
            module.merged_matmul = merged
    return e


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (their metrics are shown)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from bench.prefix_sharing import alternating_steps, demo_batch

    batch = demo_batch(16, 8, 0, 8, seed=0, min_completion_tokens=1)
    engines = {variant: lora_engine(variant == "merged") for variant in VARIANTS}
    first = {variant: [e.train_step(batch) for _ in range(args.warmup)] for variant, e in engines.items()}
    times = alternating_steps(engines, batch, args.steps)
    best = {v: min(t) for v, t in times.items()}
    median = {v: statistics.median(t) for v, t in times.items()}
    rows = [
        "| | low rank: x W^T + s (x A^T) B^T | merged: x (W + s B A)^T | low rank / merged |",
        "| --- | ---: | ---: | ---: |",
        f"| train step, best of {args.steps} (s) | {best['low rank']:.4f} | {best['merged']:.4f} | "
        f"{best['low rank'] / best['merged']:.2f}x |",
        f"| train step, median (s) | {median['low rank']:.4f} | {median['merged']:.4f} | "
        f"{median['low rank'] / median['merged']:.2f}x |",
    ]
    for i in range(args.warmup):
        rows.append(f"| step {i + 1} loss / grad_norm | {first['low rank'][i]['loss']:.7f} / "
                    f"{first['low rank'][i]['grad_norm']:.7f} | {first['merged'][i]['loss']:.7f} / "
                    f"{first['merged'][i]['grad_norm']:.7f} | |")
    setup = (f"Tiny dense Qwen3 (lorarl/assets/models/qwen3-tiny), float32 on cpu ({platform.machine()}, "
             f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} intra-op thread(s), load average "
             f"{os.getloadavg()[0]:.1f} at the end of the run); 16 task prompts x 8 completions of 1-8 tokens, "
             f"shared prompts with packed completions, GRPO, LoRA r=8 all-linear, one micro-batch; both engines "
             f"in one process, steps alternating, {args.warmup} warm-up step(s) each.")
    command = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python bench/trainer_lora_matmul.py", *sys.argv[1:]])
    body = [setup, "", *rows, "", f"Command: `{command}`"]
    print("\n".join(body))
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, "### cpu, float32, 16 x 8, demo batch", body)
        print("written to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
