"""Does one batched pass over several jobs' rows pay, against the jobs taking turns on the base? (issue #31, item 2)

A random-init model at the Qwen3-0.6B layer shape (``--layers`` decoder layers, the real 151,936-token vocabulary,
fp32) carries N adapters on one base (lorarl's ``attach_lora`` slots, ranks ``--ranks`` in turn). Per round each
job does one forward and backward of its own rows (``--shapes``: rows x tokens, every token scored through the
frozen head's closed form, lorarl.trainer.engines.head_logprobs; loss -mean logprob):

- turns: job after job with its adapters attached (lorarl.trainer.rl.lora.activate) and the merged-matmul LoRA
  path the engine uses: what the trainer does now.
- batched: one pass over every job's rows. Each LoRA linear runs the frozen base once over all rows and adds
  each job's low-rank update to its own rows (``segmented`` below: the idea of punica's SGMV and mLoRA, without
  their GPU kernels); one head pass; one backward of the jobs' summed losses, each job's gradient landing in its
  own adapter only (checked against the turns' gradients).

Both run in this process on every CPU (``torch.set_num_threads``); no prefix sharing or packing on either side.
It prints seconds per round (median of ``--reps`` after a warm-up round), trained tokens/s and batched / turns.

    .venv/bin/python bench/multi_lora_pass.py
    .venv/bin/python bench/multi_lora_pass.py --quick      # the shipped tiny model, N = 1, 2, one shape
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The code the figures depend on (bench/results.py marks a run stale once it changes).
MEASURES = ("lorarl/trainer/rl/lora.py", "lorarl/trainer/engines/head_logprobs.py")
HEADING = "## Trainer: one batched pass over several jobs vs turns"


@contextlib.contextmanager
def segmented(model, slots: list, rows: int) -> Iterator[None]:
    """Every LoRA linear of ``model`` applies job j's adapter (``slots[j]``) to rows [j*rows, (j+1)*rows) of its
    input, the frozen base to all rows at once."""
    import torch
    import torch.nn.functional as F

    from lorarl.trainer.rl.lora import LoRALinear, activate

    activate(model, None)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, module in layers:
        adapters = [slot.adapters.get(name) for slot in slots]

        def forward(x: torch.Tensor, module=module, adapters=adapters) -> torch.Tensor:
            out = F.linear(x, module.weight, module.bias)
            deltas = []
            for j, adapter in enumerate(adapters):
                part = x[j * rows:(j + 1) * rows]
                if adapter is None:
                    deltas.append(torch.zeros_like(out[j * rows:(j + 1) * rows]))
                else:
                    deltas.append(F.linear(F.linear(part, adapter.lora_a), adapter.lora_b) * adapter.scale)
            return out + torch.cat(deltas)

        module.forward = forward
    try:
        yield
    finally:
        for _, module in layers:
            del module.forward


def job_loss(model, ids, head_chunk: int):
    """-mean logprob of every next token of ``ids`` [B, T] (per row, then averaged)."""
    from lorarl.trainer.engines.head_logprobs import head_token_logprobs
    from lorarl.trainer.engines.policy_engine import token_logprobs

    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    logp, _ = head_token_logprobs(hidden[:, :-1], model.get_output_embeddings(), ids[:, 1:], False,
                                  token_logprobs, head_chunk)
    return -logp.mean(dim=1)


def round_turns(model, slots: list, batches: list, head_chunk: int) -> None:
    from lorarl.trainer.rl.lora import activate

    for slot, ids in zip(slots, batches, strict=True):
        activate(model, slot)
        job_loss(model, ids, head_chunk).mean().backward()
    activate(model, None)


def round_batched(model, slots: list, batches: list, head_chunk: int) -> None:
    import torch

    rows = batches[0].shape[0]
    with segmented(model, slots, rows):
        per_row = job_loss(model, torch.cat(batches), head_chunk)
        sum(per_row[j * rows:(j + 1) * rows].mean() for j in range(len(slots))).backward()


def adapter_params(slots: list) -> list:
    return [p for slot in slots for a in slot.adapters.values() for p in (a.lora_a, a.lora_b)]


def timed(fn, params: list, reps: int) -> float:
    times = []
    for rep in range(reps + 1):  # the first is the warm-up
        for p in params:
            p.grad = None
        start = time.perf_counter()
        fn()
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(args: argparse.Namespace, n: int, rows: int, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from lorarl.contract.lora import LoraSpec
    from lorarl.trainer.rl.lora import activate, attach_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    slots = []
    for j in range(n):
        rank = args.ranks[j % len(args.ranks)]
        slots.append(attach_lora(model, LoraSpec(rank=rank, alpha=2.0 * rank), seed=j))
        for a in slots[-1].adapters.values():  # B starts at zero: give every adapter an effect to check
            torch.nn.init.normal_(a.lora_b, std=0.02)
    activate(model, None)
    vocab = min(30000, model.config.vocab_size)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(10, vocab, (rows, tokens), generator=generator) for _ in range(n)]
    params = adapter_params(slots)

    # The same gradients both ways (fp32 rounding apart): the batched pass trains each job as its turn does.
    round_turns(model, slots, batches, args.head_chunk)
    turn_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    round_batched(model, slots, batches, args.head_chunk)
    scale = max(g.abs().max().item() for g in turn_grads)
    grad_diff = max((p.grad - g).abs().max().item() for p, g in zip(params, turn_grads, strict=True)) / scale

    turns_s = timed(lambda: round_turns(model, slots, batches, args.head_chunk), params, args.reps)
    batched_s = timed(lambda: round_batched(model, slots, batches, args.head_chunk), params, args.reps)
    trained = n * rows * (tokens - 1)
    return {"n": n, "rows": rows, "tokens": tokens, "turns_s": turns_s, "batched_s": batched_s,
            "turns_tps": trained / turns_s, "batched_tps": trained / batched_s, "grad_diff": grad_diff}


def table(args: argparse.Namespace, results: list[dict]) -> list[str]:
    lines = [f"Model: {args.shape}, ranks {args.ranks} in turn, on {torch_threads()} CPU threads; per round every "
             "job one forward + backward of its rows, every token scored; median of "
             f"{args.reps} rounds after a warm-up. 'grad diff': the largest |batched - turns| adapter gradient "
             "over the largest gradient.", "",
             "| jobs | rows x tokens per job | turns s / round | batched s / round | turns tokens/s | "
             "batched tokens/s | batched / turns | grad diff |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['n']} | {r['rows']} x {r['tokens']} | {r['turns_s']:.3f} | {r['batched_s']:.3f} | "
                     f"{r['turns_tps']:.0f} | {r['batched_tps']:.0f} | {r['turns_s'] / r['batched_s']:.2f} | "
                     f"{r['grad_diff']:.1e} |")
    return lines


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shapes", nargs="+", default=["1x128", "4x256"], help="rows x tokens per job")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--head-chunk", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="the shipped tiny model, N = 1, 2, one small shape")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if args.quick:
        args.jobs, args.shapes, args.reps, args.no_write = [1, 2], ["2x16"], 1, True
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.model, args.shape = str(ROOT / "lorarl/assets/models/qwen3-tiny"), "the shipped tiny Qwen3"
        else:
            from lorarl.assets.models import build_random_model

            args.model = str(Path(tmp) / "model")
            build_random_model("qwen3-0.6b", Path(args.model), num_layers=args.layers, dtype=torch.float32)
            args.shape = f"Qwen3-0.6B shape, {args.layers} layers, vocabulary 151,936, fp32 (random init)"
        results = [measure(args, n, rows, tokens) for rows, tokens in shapes for n in args.jobs]
    body = table(args, results)
    print("\n".join(body))
    bad = [r for r in results if not r["grad_diff"] < 1e-3]
    if bad:
        print(f"FAIL: the batched pass's gradients differ from the turns': {bad}", file=sys.stderr)
        return 1
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### {len(shapes)} shapes, N = {', '.join(map(str, args.jobs))}", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
