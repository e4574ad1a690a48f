"""Trainer benchmark: a GRPO train step with each group's prompt computed once vs once per completion.

Two TorchEngines on the shipped tiny dense Qwen3 (``assets/models/qwen3-tiny``), identical but for
``share_prompts``, train on the same demo-shaped batch: the first ``--groups`` prompts of the shipped
train split, chat-rendered as the demo sends them (14-18 tokens; ``--prompt-tokens N`` uses random
prompts of N tokens instead), ``--group-size`` completions of
``--completion-tokens`` random tokens each, GRPO, rank-8 LoRA, lr 2e-3 (examples/demo.yaml). The two
engines' steps alternate in one process, so load on a shared machine hits both alike; after warmup
steps, the best and the median of the timed steps are reported, with the ratio, and the metrics of
the first step side by side (the two paths compute the same numbers). Written into bench/RESULTS.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_sharing.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_sharing.py --prompt-tokens 30
    .venv/bin/python bench/prefix_sharing.py --micro-batch-tokens 400 --steps 10
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Trainer: shared-prompt forward"


def demo_prompts(groups: int, prompt_tokens: int, rng: random.Random) -> list[list[int]]:
    """The first ``groups`` train-split prompts chat-rendered as the demo sends them, or, when
    ``prompt_tokens`` > 0, random prompts of that length."""
    if prompt_tokens > 0:
        return [[rng.randrange(32, 127) for _ in range(prompt_tokens)] for _ in range(groups)]
    from assets.tasks import load_split
    from assets.tokenizer import default_tokenizer, prompt_token_ids

    tokenizer = default_tokenizer()
    return [prompt_token_ids(tokenizer, problem.prompt) for problem in load_split("train")[:groups]]


def demo_batch(groups: int, group_size: int, prompt_tokens: int, completion_tokens: int, seed: int) -> list:
    """Demo-shaped GRPO batch: ``groups`` prompts, random completions and 0/1 rewards."""
    from services.trainer.engine_api import TrajectoryRecord

    rng = random.Random(seed)
    out = []
    for g, prompt in enumerate(demo_prompts(groups, prompt_tokens, rng)):
        for _ in range(group_size):
            completion = [rng.randrange(32, 127) for _ in range(completion_tokens)]
            out.append(TrajectoryRecord(prompt, completion, [-1.0] * completion_tokens, [0] * completion_tokens,
                                        float(rng.random() < 0.5), f"g{g}"))
    return out


def engine(share: bool, micro_batch_tokens: int):
    from assets.paths import DENSE_MODEL_DIR
    from services.trainer.engine_api import JobSpec, OptimizerSettings
    from services.trainer.lora import LoraConfig
    from services.trainer.torch_engine import TorchEngine

    spec = JobSpec(base_model_path=str(DENSE_MODEL_DIR), lora=LoraConfig(rank=8, alpha=16),
                   optimizer=OptimizerSettings(learning_rate=2e-3, micro_batch_tokens=micro_batch_tokens))
    e = TorchEngine(spec)
    e.share_prompts = share
    return e


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="0: the shipped task prompts (14-18 tokens); N: random prompts of N tokens")
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="0: one micro-batch (the demo)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    batch = demo_batch(args.groups, args.group_size, args.prompt_tokens, args.completion_tokens, seed=0)
    prompt_lengths = sorted({len(r.prompt_token_ids) for r in batch})
    span = f"{prompt_lengths[0]}" if len(prompt_lengths) == 1 else f"{prompt_lengths[0]}-{prompt_lengths[-1]}"
    engines = {share: engine(share, args.micro_batch_tokens) for share in (False, True)}
    slots = {share: 0 for share in engines}

    def counter(share: bool):
        def hook(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
            slots[share] += kwargs["input_ids"].numel()
        return hook

    hooks = [e.model.get_decoder().register_forward_pre_hook(counter(s), with_kwargs=True) for s, e in engines.items()]
    first = {share: e.train_step(batch) for share, e in engines.items()}
    for h in hooks:
        h.remove()
    for _ in range(args.warmup - 1):
        for e in engines.values():
            e.train_step(batch)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.steps):
        for share, e in engines.items():
            start = time.perf_counter()
            e.train_step(batch)
            times[share].append(time.perf_counter() - start)

    best = {s: min(t) for s, t in times.items()}
    median = {s: statistics.median(t) for s, t in times.items()}
    tokens_plain = sum(r.num_tokens for r in batch)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in batch)
    rows = [
        "| | plain (prompt per completion) | shared prompt | plain / shared |",
        "| --- | ---: | ---: | ---: |",
        f"| train step, best of {args.steps} | {best[False]:.3f} s | {best[True]:.3f} s | "
        f"{best[False] / best[True]:.2f}x |",
        f"| train step, median | {median[False]:.3f} s | {median[True]:.3f} s | {median[False] / median[True]:.2f}x |",
        f"| decoder token slots per step (padding included) | {slots[False]:,} | {slots[True]:,} | "
        f"{slots[False] / slots[True]:.2f}x |",
        f"| first step loss | {first[False]['loss']:.7f} | {first[True]['loss']:.7f} | |",
        f"| first step grad_norm | {first[False]['grad_norm']:.7f} | {first[True]['grad_norm']:.7f} | |",
    ]
    source = ("random" if args.prompt_tokens > 0
              else f"the first {args.groups} train-split task prompts, chat-rendered as the demo sends them")
    setup = (f"Tiny dense Qwen3 (assets/models/qwen3-tiny), float32 on cpu ({platform.machine()}, {os.cpu_count()} "
             f"CPUs, torch {torch.__version__}, {args.threads} intra-op thread(s), load average "
             f"{os.getloadavg()[0]:.1f} at the end of the run); {args.groups} groups x {args.group_size} completions "
             f"of {args.completion_tokens} tokens, prompts {span} tokens ("
             f"{source}), GRPO, LoRA r=8 all-linear, "
             f"micro_batch_tokens={args.micro_batch_tokens}; both engines in one process, steps alternating, "
             f"{args.warmup} warmup step(s) each. Prompt tokens are {prompt_tokens / tokens_plain:.0%} of the plain "
             "forward's tokens.")
    command = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_sharing.py", *sys.argv[1:]])
    body = [setup, "", *rows, "", f"Command: `{command}`"]
    print("\n".join(body))
    if not args.no_write:
        from bench.results import write_results

        prompts = "task prompts" if args.prompt_tokens <= 0 else f"random {args.prompt_tokens}-token prompts"
        title = (f"### cpu, float32, {args.groups} x {args.group_size}, {prompts}, {args.completion_tokens}-token "
                 f"completions, micro_batch_tokens={args.micro_batch_tokens}")
        write_results(HEADING, title, body)
        print("written to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
