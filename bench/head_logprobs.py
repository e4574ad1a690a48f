"""Trainer benchmark: completion logprobs through a frozen 151,936-token LM head, three routes side by side.

At Qwen3's vocabulary the LM head is most of a LoRA step's compute on small and mid-size models.
Routes, each a forward and backward of the same [tokens, hidden] input through Qwen3-0.6B's frozen
head (random init, fp32 or bf16):
- "whole": autograd through the whole micro-batch's log-softmax (keeps [tokens, V] fp32 for backward);
- "chunked": autograd over checkpointed chunks (lorarl.trainer.engines.recompute; backward recomputes the logits);
- "closed form": lorarl.trainer.engines.head_logprobs (the gradient basis taken in forward; the engine's route).
Each is timed best of ``--repeats`` in one process, alternating, and the closed form's input gradient is
compared with the whole route's.

    .venv/bin/python bench/head_logprobs.py              # 2,048 tokens, 1 and 2 threads, ~3 minutes
    .venv/bin/python bench/head_logprobs.py --quick --no-write
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Trainer: LM-head logprobs, closed form vs autograd"
HIDDEN, VOCAB = 1024, 151936  # Qwen3-0.6B


def routes(chunk: int) -> dict[str, Callable]:
    from lorarl.trainer.engines.head_logprobs import head_token_logprobs
    from lorarl.trainer.engines.policy_engine import token_logprobs
    from lorarl.trainer.engines.recompute import chunked_token_logprobs

    return {
        "whole": lambda h, head, t: token_logprobs(head(h), t)[0],
        "chunked": lambda h, head, t: chunked_token_logprobs(h, head, t, False, token_logprobs, chunk)[0],
        "closed form": lambda h, head, t: head_token_logprobs(h, head, t, False, token_logprobs, chunk)[0],
    }


def measure(tokens: int, threads: int, dtype: torch.dtype, chunk: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=0.02, generator=g)
    hidden = torch.randn(1, tokens, HIDDEN, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (1, tokens), generator=g)
    best = dict.fromkeys(routes(chunk), float("inf"))
    grads: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name, fn in routes(chunk).items():
            hidden.grad = None
            start = time.perf_counter()
            fn(hidden, head, targets).sum().backward()
            best[name] = min(best[name], time.perf_counter() - start)
            grads[name] = hidden.grad.float()
    diff = (grads["closed form"] - grads["whole"]).abs().max() / grads["whole"].abs().max()
    return {**best, "diff": float(diff)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=1024, help="trainer.memory.logits_chunk_tokens")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="256 tokens, chunks of 128, one thread")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.chunk, args.threads = 256, 128, [1]
    dtype = getattr(torch, args.dtype)
    rows = ["| threads | whole s | chunked s | closed form s | closed / chunked | closed / whole | grad diff |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for threads in args.threads:
        r = measure(args.tokens, threads, dtype, args.chunk, args.repeats)
        rows.append(f"| {threads} | {r['whole']:.2f} | {r['chunked']:.2f} | {r['closed form']:.2f} | "
                    f"{r['closed form'] / r['chunked']:.2f}x | {r['closed form'] / r['whole']:.2f}x | "
                    f"{r['diff']:.1e} |")
        print(rows[-1], flush=True)
    setup = (f"Qwen3-0.6B's LM head ({HIDDEN} x {VOCAB:,}, frozen, random init), {args.dtype}, {args.tokens:,} "
             f"completion tokens, chunks of {args.chunk}; forward + backward to the input, best of {args.repeats} "
             f"alternating in one process, on {platform.machine()} with {os.cpu_count()} CPUs (torch "
             f"{torch.__version__}, load average {os.getloadavg()[0]:.1f} at the end). grad diff: the largest "
             f"difference of the closed form's input gradient from the whole route's, over its largest entry.")
    command = " ".join([".venv/bin/python bench/head_logprobs.py", *sys.argv[1:]])
    body = [setup, "", *rows, "", f"Command: `{command}`"]
    print("\n".join(body))
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### cpu, {args.dtype}, {args.tokens:,} tokens", body)
        print("written to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
