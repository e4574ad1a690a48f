"""lorarl vs TRL's GRPOTrainer at a real layer shape: seconds per step, side by side in one run.

The toy comparison (bench/trl_vs_lorarl.py) times a 1M-parameter model that decodes 8 tokens; this one
times a random-init model with Qwen3-0.6B's layer shapes (2 layers, the full 151,936-token vocabulary;
lorarl.assets.models.build_random_model) and 256-token completions, where generation and the vocabulary-wide
log-softmax dominate as they do in real jobs. Same job on both sides (examples/demo.yaml with the
overrides below: sync loop for lorarl, the same prompts in the same order, group size, learning rate,
rank-32 all-linear LoRA, GRPO loss), TRL with PEFT and HF generate in its own process on all cores
(bench/trl_grpo.py), lorarl through `lorarl run`'s stack (vLLM rollout service, trainer service).
A random policy rarely samples EOS, so both generate ~256 tokens per completion. Reported: the mean
seconds of the steps after the first (warm-up) on each side, and their ratio (goal: lorarl <= 0.5x).
Needs `make bench-setup` (trl).

    .venv/bin/python bench/trl_at_shape.py            # 3 steps each, ~15 minutes on 2 cores
    .venv/bin/python bench/trl_at_shape.py --quick --no-write
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The code this benchmark's figures depend on (bench/results.py: a run is stale once it changes): the
#: whole system, which it runs as `lorarl run` does.
MEASURES = ("lorarl",)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## lorarl vs TRL GRPOTrainer at the Qwen3-0.6B shape"
GOAL = 0.5


def job(model_dir: Path, out: Path, steps: int, tokens: int, group: int, prompts: int):
    from lorarl.client.job.config import load_job_config

    return load_job_config(str(ROOT / "examples/demo.yaml"), [
        f"model.path={model_dir}", "loop.mode=sync", f"loop.steps={steps}", f"loop.prompts_per_step={prompts}",
        "loop.eval_every=0", "data.eval_size=1", f"rollout.group_size={group}", f"rollout.max_tokens={tokens}",
        "rollout.eval_max_tokens=1", "rollout.kv_cache_gib=2", "rollout.max_lora_rank=32", "trainer.lora.rank=32",
        "trainer.lora.alpha=64", "trainer.optimizer.learning_rate=1e-4", f"output.dir={out}",
        "output.tensorboard=false", "output.progress=false"])


def per_step(seconds_at_step: dict) -> list[float]:
    """Seconds of each step from cumulative seconds at each step's end (step 1 from the start)."""
    at = sorted((int(k), v) for k, v in seconds_at_step.items())
    return [v - (at[i - 1][1] if i else 0.0) for i, (_, v) in enumerate(at)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="completion length")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 steps of 32-token completions (a smoke test)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.tokens = 2, 32

    import torch

    from bench.lorarl_job import run_job
    from bench.trl_vs_lorarl import run_trl, trl_spec
    from lorarl.assets.models import build_random_model

    with tempfile.TemporaryDirectory(prefix="lorarl-trl-shape-") as tmp:
        model_dir = Path(tmp) / "model"
        build_random_model("qwen3-0.6b", model_dir, num_layers=2, dtype=torch.float32)
        cfg = job(model_dir, Path(tmp) / "lorarl", args.steps, args.tokens, args.group_size, args.prompts_per_step)
        timing = run_job(cfg, Path(tmp) / "lorarl")
        ours = per_step(timing.train_s_at_step)
        spec = trl_spec(cfg, threads=os.cpu_count() or 2, export_every=0)
        peer_result = run_trl(spec, Path(tmp) / "trl")
        assert peer_result is not None
        peer = per_step(peer_result["train_s_at_step"])
        tokens = sum(row["rollout/tokens"] for row in timing.steps) / max(len(timing.steps), 1)
    mean = lambda xs: sum(xs[1:]) / max(len(xs) - 1, 1)  # noqa: E731  (steps after the first)
    ratio = mean(ours) / mean(peer)
    lines = ["| side | step 1 s | later steps s (mean) | each step s |", "| --- | ---: | ---: | --- |",
             f"| lorarl (vLLM rollout + trainer services, sync) | {ours[0]:.1f} | {mean(ours):.1f} | "
             + ", ".join(f"{s:.1f}" for s in ours) + " |",
             f"| TRL GRPOTrainer (PEFT, HF generate, {peer_result['threads']} threads) | {peer[0]:.1f} | "
             f"{mean(peer):.1f} | " + ", ".join(f"{s:.1f}" for s in peer) + " |",
             "", f"lorarl / TRL seconds per step: {ratio:.2f}x "
             f"(goal <= {GOAL}x: {'PASS' if ratio <= GOAL else 'FAIL'});"
             f" {args.prompts_per_step} prompts x {args.group_size} completions of up to {args.tokens} tokens "
             f"({tokens:.0f} completion tokens per lorarl step)"]
    print("\n".join(lines))
    if not args.no_write:
        from bench.results import write_results

        title = (f"### {time.strftime('%Y-%m-%d')}, qwen3-0.6b shape x 2 layers (random init, fp32), "
                 f"{args.tokens}-token completions, {platform.machine()} {os.cpu_count()} cores"
                 + (" (quick)" if args.quick else ""))
        write_results(HEADING, title, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
