"""Trainer benchmark: one LoRA step vs one full-parameter step on the same Qwen3-0.6B-shaped batch.

Builds a random-init model with Qwen3-0.6B's shapes (hidden 1024, intermediate 3072, 16 heads,
8 KV heads, head_dim 128, vocab 151936, tied embeddings; layers reduced by ``--layers``) in memory
from a Qwen3Config, never downloading anything, and saves it to a temp dir. Each variant then runs in
its own subprocess through the real TorchEngine, so peak memory is that variant's alone:

* CPU: peak resident set size during training (VmHWM, reset after the model is loaded);
* CUDA: torch.cuda.max_memory_allocated (reset after the model is loaded).

Prints a side-by-side table with ratios and PASS/FAIL against the targets (LoRA peak memory
<= 0.5x full, LoRA optimiser state <= 3% of full) and writes it into bench/RESULTS.md.

    .venv/bin/python bench/trainer_lora_vs_full.py                 # cpu, 4 layers
    .venv/bin/python bench/trainer_lora_vs_full.py --device cuda --layers 28
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
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADING = "## Trainer: LoRA vs full fine-tuning"
MEMORY_TARGET = 0.5
OPTIMIZER_TARGET = 0.03


def qwen3_06b_config(layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_model(layers: int, out_dir: Path) -> None:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(qwen3_06b_config(layers)).save_pretrained(out_dir)


def lora_share_at(layers: int, rank: int) -> tuple[int, int]:
    """(LoRA params, all params) of the all-linear adapter for a model with ``layers`` layers (no weights built)."""
    from transformers import Qwen3ForCausalLM

    from lorarl.trainer.rl.lora import DENSE_TARGETS

    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_06b_config(layers))
    total = sum(p.numel() for p in model.parameters())
    lora = sum(rank * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in DENSE_TARGETS)
    return lora, total


def make_batch(sequences: int, prompt_tokens: int, completion_tokens: int):
    from lorarl.trainer.engines.api import TrajectoryRecord

    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(sequences):
        prompt = torch.randint(0, 151936, (prompt_tokens,), generator=g).tolist()
        completion = torch.randint(0, 151936, (completion_tokens,), generator=g).tolist()
        out.append(TrajectoryRecord(prompt, completion, [-12.0] * completion_tokens, [0] * completion_tokens,
                                    float(i % 2), group_id=f"g{i // 2}"))
    return out


# ---------------------------------------------------------------- memory probes


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def current_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# ---------------------------------------------------------------- one variant (subprocess)


def run_variant(args: argparse.Namespace) -> dict:
    from lorarl.trainer.engines.api import OptimizerSpec, TrainingSpec
    from lorarl.trainer.engines.torch.engine import TorchEngine
    from lorarl.trainer.rl.lora import LoraConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    full = args.worker == "full"
    spec = TrainingSpec(base_model_path=args.model_dir, device=args.device, dtype=args.dtype,
                   lora=LoraConfig(rank=args.rank, alpha=2 * args.rank), full_finetune=full,
                   optimizer=OptimizerSpec(learning_rate=1e-5, max_grad_norm=1.0))
    engine = TorchEngine(spec)
    batch = make_batch(args.sequences, args.prompt_tokens, args.completion_tokens)
    reset_peak(args.device)
    loaded = current_bytes(args.device)
    times = []
    for _ in range(args.steps + 1):  # the first step (allocations, optimiser state) is warmup
        start = time.perf_counter()
        engine.train_step(batch)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    optimizer_bytes = sum(t.numel() * t.element_size() for state in engine.optimizer.state.values()
                          for t in state.values() if torch.is_tensor(t))
    import transformers

    cuda = args.device.startswith("cuda")
    return {"device_name": torch.cuda.get_device_name(engine.device) if cuda else platform.machine(),
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                        f"{torch.get_num_threads()} intra-op threads",
            "peak_bytes": peak_bytes(args.device), "loaded_bytes": loaded, "optimizer_bytes": optimizer_bytes,
            "step_s": min(times[1:]), "first_step_s": times[0],
            "trainable": engine.trainable_parameters, "total": engine.total_parameters}


def spawn_variant(variant: str, model_dir: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--model-dir", str(model_dir), "--device", args.device,
           "--dtype", args.dtype, "--rank", str(args.rank), "--steps", str(args.steps),
           "--sequences", str(args.sequences), "--prompt-tokens", str(args.prompt_tokens),
           "--completion-tokens", str(args.completion_tokens), "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- report


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def report(args: argparse.Namespace, lora: dict, full: dict) -> tuple[list[str], bool]:
    mem_ratio = lora["peak_bytes"] / full["peak_bytes"]
    opt_ratio = lora["optimizer_bytes"] / full["optimizer_bytes"]
    mem_ok, opt_ok = mem_ratio <= MEMORY_TARGET, opt_ratio <= OPTIMIZER_TARGET
    lora28, total28 = lora_share_at(28, args.rank)
    peak_kind = "peak GPU memory allocated" if args.device.startswith("cuda") else "peak RSS while training"
    rows = [
        f"| metric | LoRA (r={args.rank}, all-linear) | full fine-tune | LoRA / full | target | result |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        f"| {peak_kind} | {mib(lora['peak_bytes'])} | {mib(full['peak_bytes'])} | {mem_ratio:.3f} | "
        f"<= {MEMORY_TARGET} | {'PASS' if mem_ok else 'FAIL'} |",
        f"| optimizer state | {mib(lora['optimizer_bytes'])} | {mib(full['optimizer_bytes'])} | {opt_ratio:.4f} | "
        f"<= {OPTIMIZER_TARGET} | {'PASS' if opt_ok else 'FAIL'} |",
        f"| step time (best of {args.steps}) | {lora['step_s']:.2f} s | {full['step_s']:.2f} s | "
        f"{lora['step_s'] / full['step_s']:.3f} | | |",
        f"| trainable parameters | {lora['trainable']:,} | {full['trainable']:,} | "
        f"{lora['trainable'] / full['trainable']:.4f} | | |",
        f"| memory after load (before the first step) | {mib(lora['loaded_bytes'])} | {mib(full['loaded_bytes'])} |"
        " | | |",
    ]
    load = os.getloadavg()[0]
    setup = (f"Qwen3-0.6B shapes with {args.layers} layers ({full['total']:,} parameters, random init, built "
             f"locally), {args.dtype} on {args.device} ({lora['device_name']}, {os.cpu_count()} CPUs, "
             f"{lora['versions']}, load average {load:.1f} at the end of the run); "
             f"batch of {args.sequences} sequences x ({args.prompt_tokens} prompt + {args.completion_tokens} "
             "completion) tokens, GRPO loss, AdamW; "
             "each variant in its own process, one warmup step, then the best of the timed steps (on a shared "
             "machine the minimum is the least disturbed). "
             f"At the real 28 layers the all-linear rank-{args.rank} adapter is {lora28:,} of {total28:,} "
             f"parameters ({lora28 / total28:.2%}), which bounds the optimizer-state ratio the same way.")
    if args.dtype == "bfloat16":
        setup += (" In bfloat16 the full fine-tune keeps bf16 Adam moments while adapters keep fp32 ones, so the "
                  "optimizer-state ratio is twice the parameter ratio.")
    command = " ".join([".venv/bin/python bench/trainer_lora_vs_full.py", *sys.argv[1:]])
    return [setup, "", *rows, "", f"Command: `{command}`"], mem_ok and opt_ok


def subsection_title(args: argparse.Namespace) -> str:
    return (f"### {args.device}, {args.dtype}, {args.layers} layers, {args.sequences} x "
            f"({args.prompt_tokens}+{args.completion_tokens}) tokens")


def write_results(title: str, body: list[str]) -> None:
    """This run under its own sub-heading of this benchmark's section of bench/RESULTS.md."""
    from bench.results import write_results as write_section

    write_section(HEADING, title, body, RESULTS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3-0.6B has 28)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warmup step")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op CPU threads per variant (0: torch's default); 1 is steadier on a busy machine")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    parser.add_argument("--worker", choices=["lora", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_variant(args)))
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lorarl-bench-") as tmp:
        model_dir = Path(tmp) / "qwen3-0.6b-shaped"
        build_model(args.layers, model_dir)
        results = {variant: spawn_variant(variant, model_dir, args) for variant in ("lora", "full")}
    body, ok = report(args, results["lora"], results["full"])
    title = subsection_title(args)
    print("\n".join([HEADING, "", title, "", *body]))
    print(f"total time {time.perf_counter() - started:.0f} s")
    if not args.no_write:
        write_results(title, body)
        print(f"written to {RESULTS}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
