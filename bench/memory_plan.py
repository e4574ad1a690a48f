"""Trainer memory: what the `--dry-run` plan predicts against the peak a real train step reaches.

Random-init models with real Qwen3 layer shapes (a few layers, the full 151,936-token vocabulary) are
built locally (lorarl.assets.models.build_random_model). Each row runs in a fresh process: a TorchEngine
(rank-32 all-linear LoRA) is created, then one forward_backward on a micro-batch of ``batch`` x
``seq`` tokens (distinct prompts of 64 tokens, so the plain forward runs: the plan's formula is per
token of the padded micro-batch), with activation checkpointing on or off. Measured:

- CPU: the process's peak resident set (VmHWM, reset once the engine is built) minus its resident set
  before the step: the step's own bytes; and the whole process's peak against the plan's total
  (weights + adapters, gradients, Adam + step + lorarl.trainer.engines.memory.CPU_RUNTIME_BYTES). The measured
  process runs with glibc's mmap threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so blocks it frees go
  back to the OS and its resident set follows the live tensors, as max_memory_allocated does on CUDA. With
  glibc's default (a threshold that rises to 32 MiB) a checkpointed step kept 0.03-0.33 GiB of freed heap
  resident at the 0.6B and 8B shapes (2026-12-01): the plan counts tensors, not the allocator's slack.
- CUDA (``--device cuda``): torch.cuda.max_memory_allocated, reset after the engine is built.

The plan's numbers come from lorarl.trainer.engines.memory, the formulas the engine's "auto" decides by;
every row prints plan / measured, and the run fails (exit 1) if any ratio leaves [0.8, 1.2].

    OMP_NUM_THREADS=2 .venv/bin/python bench/memory_plan.py            # CPU rows, ~15 minutes
    .venv/bin/python bench/memory_plan.py --quick --no-write           # two short rows
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Trainer: memory plan vs measured"
RANK = 32
PROMPT = 64
TOLERANCE = 0.2


@dataclass(frozen=True)
class Row:
    shape: str
    layers: int
    dtype: str
    batch: int
    seq: int
    checkpointing: bool


FULL_ROWS = [
    *(Row("qwen3-0.6b", 2, "float32", b, s, c) for b, s in ((1, 512), (4, 512), (1, 2048), (2, 2048), (1, 8192))
      for c in (False, True)),
    *(Row("qwen3-8b", 2, "bfloat16", 1, s, c) for s in (1024, 4096) for c in (False, True)),
]
QUICK_ROWS = [Row("qwen3-0.6b", 2, "float32", 1, 512, c) for c in (False, True)]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(row: Row, model_dir: str, device: str) -> dict[str, float]:
    """One row in this process: the engine, one forward_backward, the peaks (bytes)."""
    import torch

    from lorarl.trainer.engines.api import MemorySpec, OptimizerSpec, TrainingSpec, TrajectoryRecord
    from lorarl.trainer.engines.torch.engine import TorchEngine
    from lorarl.trainer.rl.lora import LoraConfig

    spec = TrainingSpec(base_model_path=model_dir, device=device, dtype=row.dtype,
                   lora=LoraConfig(rank=RANK, alpha=2 * RANK), optimizer=OptimizerSpec(learning_rate=1e-4),
                   memory=MemorySpec(activation_checkpointing="on" if row.checkpointing else "off"))
    engine = TorchEngine(spec)
    vocab = engine.vocab_size
    completion = row.seq - PROMPT
    records = [TrajectoryRecord([(97 * i + j) % (vocab - 1) + 1 for j in range(PROMPT)],
                                [(31 * j + i) % (vocab - 1) + 1 for j in range(completion)], [-1.0] * completion,
                                [0] * completion, float(i % 2), f"g{i}") for i in range(row.batch)]
    with torch.no_grad():  # weights load as views of the mmapped files: make every page resident first
        for p in engine.model.parameters():
            p.sum()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
        before = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    engine.forward_backward(records)
    seconds = time.perf_counter() - start
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kib("VmHWM") * 1024
    return {"before": before, "peak": peak, "step": peak - before, "seconds": seconds}


def planned(row: Row, shape: dict, device: str) -> dict[str, float]:
    from lorarl.client.job.plan import ADAPTER_BYTES, count
    from lorarl.trainer.engines.memory import CPU_RUNTIME_BYTES, dtype_bytes, step_memory

    step = step_memory(shape, RANK, row.dtype, row.batch * row.seq, row.checkpointing, 1024)
    n = count(shape, RANK)
    static = n["base"] * dtype_bytes(row.dtype) + 4 * n["lora"] * ADAPTER_BYTES
    runtime = 0 if device.startswith("cuda") else CPU_RUNTIME_BYTES
    return {"step": step.total, "total": static + step.total + runtime}


def run_row(row: Row, model_dir: str, device: str, threads: int) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if not device.startswith("cuda"):
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # resident set = live tensors (see the docstring)
    done = subprocess.run([sys.executable, __file__, "--measure", json.dumps(row.__dict__), "--model-dir", model_dir,
                           "--device", device], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{row}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short rows (a smoke test)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Row(**json.loads(args.measure)), args.model_dir, args.device)))
        return 0

    from lorarl.assets.models import build_random_model

    rows = QUICK_ROWS if args.quick else FULL_ROWS
    lines = ["| shape (layers) | dtype | ckpt | batch x seq | plan step GiB | measured step GiB | step plan/meas. | "
             "plan total GiB | measured peak GiB | total plan/meas. | step s |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    worst = 1.0
    with tempfile.TemporaryDirectory(prefix="lorarl-memory-") as tmp:
        models: dict[tuple[str, int, str], str] = {}
        for row in rows:
            key = (row.shape, row.layers, row.dtype)
            if key not in models:
                import torch

                out = Path(tmp) / f"{row.shape}-{row.layers}-{row.dtype}"
                build_random_model(row.shape, out, num_layers=row.layers, dtype=getattr(torch, row.dtype))
                models[key] = str(out)
            shape = json.loads((Path(models[key]) / "config.json").read_text())
            got = run_row(row, models[key], args.device, args.threads)
            plan = planned(row, shape, args.device)
            step_ratio = plan["step"] / got["step"]
            total_ratio = plan["total"] / got["peak"] if not args.device.startswith("cuda") else step_ratio
            worst = max(worst, abs(step_ratio - 1) + 1, abs(total_ratio - 1) + 1)
            line = (f"| {row.shape} ({row.layers}) | {row.dtype} | {'on' if row.checkpointing else 'off'} | "
                    f"{row.batch} x {row.seq} | {gib(plan['step'])} | {gib(got['step'])} | {step_ratio:.2f} | "
                    f"{gib(plan['total'])} | {gib(got['peak'])} | {total_ratio:.2f} | {got['seconds']:.1f} |")
            print(line, f"(before the step: {gib(got['before'])} GiB)", flush=True)
            lines.append(line)
    ok = worst <= 1 + TOLERANCE
    verdict = f"every row within ±{TOLERANCE:.0%}: {'PASS' if ok else 'FAIL'} (worst {worst - 1:+.0%} off)"
    print(verdict)
    if not args.no_write:
        from bench.results import write_results

        title = (f"### {time.strftime('%Y-%m-%d')}, {args.device}, {platform.machine()} {os.cpu_count()} cores, "
                 f"rank {RANK}, {args.threads} threads{' (quick)' if args.quick else ''}")
        allocator = "" if args.device.startswith("cuda") else (
            "CPU rows measured with MALLOC_MMAP_THRESHOLD_=1048576 (resident set = live tensors; see the "
            "script's docstring for glibc's default).")
        write_results(HEADING, title, [*lines, "", verdict, *(["", allocator] if allocator else [])])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
