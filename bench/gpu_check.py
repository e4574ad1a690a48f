"""The GPU check in one go (under 10 minutes on one GPU): trainer memory and speed at real layer shapes,
the Megatron engine, and the rollout engine with CUDA graphs where the device's image has vLLM.

1. trainer: one forward_backward on random-init Qwen3-0.6B and 1.7B shapes (4 layers, full vocabulary,
   bf16, rank-32 LoRA) at 2048 and 8192 tokens, activation checkpointing off and on, each in a fresh
   process: torch.cuda.max_memory_allocated against the plan (lorarl.trainer.engines.memory), and seconds;
2. megatron: bench/megatron_gpu_check.py (parity with the torch engine, learning, export, step time);
3. one base: bench/one_base_gpu.py (a trainer and a rollout process on ONE copy of a Qwen3-8B-shaped base,
   shared by CUDA IPC: device memory, generation, an adapter handoff, logprob parity, step time at 2K-32K tokens);
4. rollout: where vLLM imports with a GPU platform, one engine on the 0.6B shape, generation tokens/s
   with CUDA graphs (rollout.enforce_eager null) and eager, side by side.

Each part reports on its own (a failure is printed, the others still run); the report goes to
bench/RESULTS.md unless --no-write. `--device cpu --quick` runs the same code on CPU with small sizes
(what the unit test runs), so the script does not rot between GPU sessions.

    python bench/gpu_check.py                       # on the GPU machine
    python bench/gpu_check.py --device cpu --quick --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## GPU check"


def trainer_rows(device: str, quick: bool, tmp: Path) -> list[str]:
    import json

    import torch

    from bench.memory_plan import Row, planned, run_row
    from lorarl.assets.models import build_random_model

    dtype = "float32" if device == "cpu" else "bfloat16"
    shapes = [("qwen3-0.6b", 1 if quick else 4)] + ([] if quick else [("qwen3-1.7b", 4)])
    lengths = (256,) if quick else (2048, 8192)
    lines = ["| shape (layers) | ckpt | tokens | plan GiB | measured GiB | plan/meas. | step s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for shape, layers in shapes:
        model_dir = tmp / f"{shape}-{layers}"
        build_random_model(shape, model_dir, num_layers=layers, dtype=getattr(torch, dtype))
        config = json.loads((model_dir / "config.json").read_text())
        for seq in lengths:
            for checkpointing in (False, True):
                row = Row(shape, layers, dtype, 1, seq, checkpointing)
                got = run_row(row, str(model_dir), device, threads=2 if device == "cpu" else 8)
                plan = planned(row, config, device)["step"]
                lines.append(f"| {shape} ({layers}) | {'on' if checkpointing else 'off'} | {seq} | {plan / 2**30:.2f} "
                             f"| {got['step'] / 2**30:.2f} | {plan / got['step']:.2f} | {got['seconds']:.2f} |")
                print(lines[-1], flush=True)
    return lines


def megatron_rows(device: str, quick: bool) -> list[str]:
    command = [sys.executable, str(ROOT / "bench" / "megatron_gpu_check.py"), "--device", device,
               *(["--quick"] if quick else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=420)
    tail = done.stdout.strip().splitlines()[-12:]
    if done.returncode:
        tail += done.stderr.strip().splitlines()[-12:]
    return [f"exit code {done.returncode}", "", "```", *tail, "```"]


def one_base_rows(device: str, quick: bool) -> list[str]:
    """bench/one_base_gpu.py: trainer and rollout processes on ONE copy of the base (CUDA IPC), its table."""
    command = [sys.executable, str(ROOT / "bench" / "one_base_gpu.py"), "--device", device, "--no-write",
               *(["--quick"] if quick else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=540)
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    if done.returncode:
        raise RuntimeError("\n".join([*table, *done.stderr.strip().splitlines()[-12:]]))
    return ["| check | figure |", "| --- | ---: |", *table]  # the script prints its rows only


def rollout_rows(device: str, quick: bool, tmp: Path) -> list[str]:
    if device == "cpu":
        return ["skipped on CPU (the rollout's CPU numbers are bench/rollout_throughput.py's)"]
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return ["skipped: vLLM is not installed in this image"]
    if current_platform.is_cpu():
        return ["skipped: this vLLM build is the CPU one"]
    import torch

    from lorarl.assets.models import build_random_model
    from lorarl.rollout.config import RolloutSettings
    from lorarl.rollout.vllm.engine import VllmEngine

    model_dir = tmp / "rollout-model"
    build_random_model("qwen3-0.6b", model_dir, num_layers=4, dtype=torch.bfloat16)
    lines = ["| CUDA graphs | sequences x tokens | seconds | tokens/s |", "| --- | ---: | ---: | ---: |"]
    for eager in (False, True):
        settings = RolloutSettings(model_path=str(model_dir), dtype="bfloat16", enforce_eager=eager,
                                   gpu_memory_utilization=0.3, max_model_len=4096, enable_lora=False)
        seconds, tokens = asyncio.run(_generate(VllmEngine(settings), 64, 512))
        lines.append(f"| {'off' if eager else 'on'} | 64 x 512 | {seconds:.2f} | {tokens / seconds:.0f} |")
        print(lines[-1], flush=True)
    return lines


async def _generate(engine, sequences: int, tokens: int) -> tuple[float, int]:
    """Seconds and tokens of one batch of greedy, EOS-ignoring segments (after a warm-up segment)."""
    from lorarl.rollout.schema import Sampling, SegmentSpec

    sampling = Sampling(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    async def one(i: int) -> int:
        spec = SegmentSpec(f"r{i}", tuple((7 * i + j) % 1000 + 1 for j in range(64)), sampling, stream=False)
        return sum([len(event.token_ids) async for event in engine.submit(spec)])

    await engine.start()
    try:
        await one(-1)
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(sequences)))
        return time.perf_counter() - start, sum(counts)
    finally:
        await engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (the CPU smoke test)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    report: list[str] = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="lorarl-gpu-check-") as tmp:
        parts = (("trainer memory and step time", lambda: trainer_rows(args.device, args.quick, Path(tmp))),
                 ("megatron engine", lambda: megatron_rows(args.device, args.quick)),
                 ("one base: trainer and rollout on one copy (bench/one_base_gpu.py)",
                  lambda: one_base_rows(args.device, args.quick)),
                 ("rollout engine", lambda: rollout_rows(args.device, args.quick, Path(tmp))))
        for done, (title, part) in enumerate(parts, 1):
            started = time.perf_counter()
            try:
                lines = part()
            except Exception:  # one part failing must not hide the others' numbers
                failed += 1
                lines = ["FAILED:", "", "```", *traceback.format_exc().strip().splitlines()[-8:], "```"]
            report += [f"**{title}** ({time.perf_counter() - started:.0f} s)", "", *lines, ""]
            print("\n".join(report[-len(lines) - 3:]), flush=True)
            # written after every part: a device lease that ends mid-run keeps the parts that finished
            left = ", ".join(name for name, _ in parts[done:])
            if not args.no_write:
                write(args.device, report + ([f"**not run**: the run stopped before {left}"] if left else []))
    return 1 if failed else 0


def write(device: str, report: list[str]) -> None:
    from bench.results import write_results

    write_results(HEADING, f"### {time.strftime('%Y-%m-%d')}, {device}", report)


if __name__ == "__main__":
    sys.exit(main())
