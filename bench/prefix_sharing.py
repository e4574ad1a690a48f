"""Trainer benchmark: a GRPO train step with each group's prompt computed once vs once per completion.

Three TorchEngines on the shipped tiny dense Qwen3 (``lorarl/assets/models/qwen3-tiny``), identical but for
``share_prompts`` / ``pack_completions``: plain (every row's prompt+completion), shared prompts with
the completions in padded rows, and shared prompts with the completions packed into lines
(lorarl.trainer.engines.torch.prefix_sharing picks packing by its cost estimate; the table says which layout
ran). They train on the same demo-shaped batch: the first ``--groups`` prompts of the shipped train
split, chat-rendered as the demo sends them (14-18 tokens; ``--prompt-tokens N`` uses random prompts
of N tokens instead), ``--group-size`` completions of ``--completion-tokens`` random tokens each, or
of a random length in [``--min-completion-tokens``, ``--completion-tokens``] (the demo's completions
stop at EOS: 1-8 tokens, ~4.7 on average), GRPO, rank-8 LoRA, lr 2e-3 (examples/demo.yaml). The
engines' steps alternate in one process, so load on a shared machine hits all alike; after warmup
steps, the best and the median of the timed steps are reported, with the ratios, and the metrics of
the first step side by side (the paths compute the same numbers). Written into bench/RESULTS.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_sharing.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_sharing.py --min-completion-tokens 1
    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_sharing.py --prompt-tokens 30
    .venv/bin/python bench/prefix_sharing.py --micro-batch-tokens 400 --steps 10
"""

from __future__ import annotations

import argparse
import math
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
    from lorarl.assets.tasks import load_split
    from lorarl.assets.tokenizer import default_tokenizer, prompt_token_ids

    tokenizer = default_tokenizer()
    return [prompt_token_ids(tokenizer, problem.prompt) for problem in load_split("train")[:groups]]


def demo_batch(groups: int, group_size: int, prompt_tokens: int, completion_tokens: int, seed: int,
               min_completion_tokens: int = 0) -> list:
    """Demo-shaped GRPO batch: ``groups`` prompts, random completions (``completion_tokens`` long, or of a
    uniformly drawn length from ``min_completion_tokens`` when > 0) and 0/1 rewards."""
    from lorarl.trainer.engines.api import TrajectoryRecord

    rng = random.Random(seed)
    low = min_completion_tokens if min_completion_tokens > 0 else completion_tokens
    out = []
    for g, prompt in enumerate(demo_prompts(groups, prompt_tokens, rng)):
        for _ in range(group_size):
            n = rng.randint(low, completion_tokens)
            completion = [rng.randrange(32, 127) for _ in range(n)]
            out.append(TrajectoryRecord(prompt, completion, [-1.0] * n, [0] * n, float(rng.random() < 0.5), f"g{g}"))
    return out


#: The benchmarked variants: (share_prompts, pack_completions) and their column titles.
VARIANTS = {"plain": (False, False), "padded": (True, False), "packed": (True, True)}
TITLES = {"plain": "plain (prompt per completion)", "padded": "shared prompt, padded completions",
          "packed": "shared prompt, packed completions"}


def engine(variant: str, micro_batch_tokens: int):
    from lorarl.assets.paths import DENSE_MODEL_DIR
    from lorarl.trainer.engines.api import OptimizerSpec, TrainingSpec
    from lorarl.trainer.engines.torch.engine import TorchEngine
    from lorarl.trainer.rl.lora import LoraConfig

    spec = TrainingSpec(base_model_path=str(DENSE_MODEL_DIR), lora=LoraConfig(rank=8, alpha=16),
                   optimizer=OptimizerSpec(learning_rate=2e-3, micro_batch_tokens=micro_batch_tokens))
    e = TorchEngine(spec)
    e.share_prompts, e.pack_completions = VARIANTS[variant]
    return e


def alternating_steps(engines: dict, batch: list, steps: int) -> dict[str, list[float]]:
    """Seconds of each engine's train steps, the engines taking turns so machine load hits all alike."""
    times: dict[str, list[float]] = {variant: [] for variant in engines}
    for _ in range(steps):
        for variant, e in engines.items():
            start = time.perf_counter()
            e.train_step(batch)
            times[variant].append(time.perf_counter() - start)
    return times


def packed_micro_batches(batch: list, micro_batch_tokens: int, model: torch.nn.Module, repeats: int = 10
                         ) -> tuple[int, int, float]:
    """(micro-batches the packed engine packs, micro-batches, seconds to plan them and build their
    packed inputs and masks, best of ``repeats``): the layout's own overhead, measured apart from the step."""
    from lorarl.trainer.engines.torch.prefix_sharing import (
        attention_cost,
        packed_completion_inputs,
        plan_prefix_sharing,
    )
    from lorarl.trainer.rl.batching import micro_batches, pack

    weight = attention_cost(model)
    micros = [pack([batch[i] for i in idx]) for idx in micro_batches([r.num_tokens for r in batch],
                                                                        micro_batch_tokens)]
    best, packed = math.inf, 0
    for _ in range(repeats):
        start = time.perf_counter()
        packed = 0
        for micro in micros:
            plan = plan_prefix_sharing(micro, weight)
            if plan is not None and plan.completions.packed:
                packed += 1
                P = plan.prompt_ids.shape[1]
                prompt_mask = (torch.arange(P) < plan.prompt_lengths.unsqueeze(1)).long()
                row_len = plan.prompt_lengths.index_select(0, plan.row_prompt).unsqueeze(1)
                packed_completion_inputs(micro, plan, row_len, prompt_mask, None)
        best = min(best, time.perf_counter() - start)
    return packed, len(micros), best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="0: the shipped task prompts (14-18 tokens); N: random prompts of N tokens")
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--min-completion-tokens", type=int, default=0,
                        help="> 0: completion lengths drawn uniformly from [this, --completion-tokens]")
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="0: one micro-batch (the demo)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    batch = demo_batch(args.groups, args.group_size, args.prompt_tokens, args.completion_tokens, seed=0,
                       min_completion_tokens=args.min_completion_tokens)
    prompt_lengths = sorted({len(r.prompt_token_ids) for r in batch})
    span = f"{prompt_lengths[0]}" if len(prompt_lengths) == 1 else f"{prompt_lengths[0]}-{prompt_lengths[-1]}"
    lengths = [len(r.completion_token_ids) for r in batch]
    engines = {variant: engine(variant, args.micro_batch_tokens) for variant in VARIANTS}
    packed_micros, micros, plan_s = packed_micro_batches(batch, args.micro_batch_tokens, engines["packed"].model)
    slots = {variant: 0 for variant in engines}

    def counter(variant: str):
        def hook(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
            slots[variant] += kwargs["input_ids"].numel()
        return hook

    hooks = [e.model.get_decoder().register_forward_pre_hook(counter(v), with_kwargs=True) for v, e in engines.items()]
    first = {variant: e.train_step(batch) for variant, e in engines.items()}
    for h in hooks:
        h.remove()
    for _ in range(args.warmup - 1):
        for e in engines.values():
            e.train_step(batch)
    times = alternating_steps(engines, batch, args.steps)
    best = {v: min(t) for v, t in times.items()}
    median = {v: statistics.median(t) for v, t in times.items()}
    tokens_plain = sum(r.num_tokens for r in batch)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in batch)

    def row(title: str, values: dict, fmt: str, ratio: bool = True) -> str:
        cells = " | ".join(format(values[v], fmt) for v in VARIANTS)
        ratios = (f"{values['plain'] / values['padded']:.2f}x | {values['plain'] / values['packed']:.2f}x | "
                  f"{values['padded'] / values['packed']:.2f}x |") if ratio else "| | |"
        return f"| {title} | {cells} | {ratios}"

    rows = [
        f"| | {' | '.join(TITLES[v] for v in VARIANTS)} | plain / padded | plain / packed | padded / packed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        row(f"train step, best of {args.steps} (s)", best, ".3f"),
        row("train step, median (s)", median, ".3f"),
        row("decoder token slots per step (padding included)", slots, ","),
        row("first step loss", {v: first[v]["loss"] for v in VARIANTS}, ".7f", ratio=False),
        row("first step grad_norm", {v: first[v]["grad_norm"] for v in VARIANTS}, ".7f", ratio=False),
    ]
    source = ("random" if args.prompt_tokens > 0
              else f"the first {args.groups} train-split task prompts, chat-rendered as the demo sends them")
    completions = (f"{args.completion_tokens} tokens" if args.min_completion_tokens <= 0 else
                   f"{args.min_completion_tokens}-{args.completion_tokens} tokens (mean "
                   f"{statistics.mean(lengths):.1f})")
    setup = (f"Tiny dense Qwen3 (lorarl/assets/models/qwen3-tiny), float32 on cpu ({platform.machine()}, "
             f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} intra-op thread(s), load average "
             f"{os.getloadavg()[0]:.1f} at the end of the run); {args.groups} groups x {args.group_size} completions "
             f"of {completions}, prompts {span} tokens ("
             f"{source}), GRPO, LoRA r=8 all-linear, "
             f"micro_batch_tokens={args.micro_batch_tokens}; the engines in one process, steps alternating, "
             f"{args.warmup} warmup step(s) each. Prompt tokens are {prompt_tokens / tokens_plain:.0%} of the plain "
             f"forward's tokens. The packed engine packed {packed_micros} of {micros} micro-batch(es); planning "
             f"them and building their packed inputs and masks takes {plan_s * 1e3:.2f} ms per step (best of 10).")
    command = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_sharing.py", *sys.argv[1:]])
    body = [setup, "", *rows, "", f"Command: `{command}`"]
    print("\n".join(body))
    if not args.no_write:
        from bench.results import write_results

        prompts = "task prompts" if args.prompt_tokens <= 0 else f"random {args.prompt_tokens}-token prompts"
        title = (f"### cpu, float32, {args.groups} x {args.group_size}, {prompts}, {completions.split(' (')[0]} "
                 f"completions, micro_batch_tokens={args.micro_batch_tokens}")
        write_results(HEADING, title, body)
        print("written to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
