"""Routing replay (R3) at Qwen3-30B-A3B's shape: mismatch with and without it, and what recording and replaying
cost, side by side in one run.

Model: random init with Qwen3-30B-A3B's layer shapes (hidden 2048, 32/4 heads of 128, top-8 of 128 experts of
768, untied 151,936 vocabulary), --layers decoder layers, the experts' weights scaled as
lorarl.assets.models.EXPERT_INIT_SCALE says (so that which experts a token reaches matters, as in a trained model).
Rollout: vLLM (CPU here) in bfloat16, the common sampler dtype; trainer: each of --engines (the torch engine and the
Megatron engine, one process, float32), one after the other on the same batch. One batch of --prompts prompts x
--samples samples x --tokens tokens, sampled at temperature 1 by an engine that records routes.

- mismatch: KL(rollout || trainer) of the sampled tokens (k3 and k1, lorarl.trainer.rl.correction) with the
  trainer routing live and with it replaying the recorded routes, and how often its live routers pick another
  expert set (per token and MoE layer; per token in any layer);
- recording: generation tokens/s of the same batch on an engine that records and on one that does not (which keeps
  vLLM's prefix caching, as a job without R3 does; recording turns it off), best of --reps;
- replaying: the trainer's forward+backward of the batch with and without routes, median of --reps;
- bytes: the trajectories' serialized size with and without routes, per token and per batch.

    .venv/bin/python bench/routing_replay.py                 # 2 layers of Qwen3-30B-A3B's shape
    .venv/bin/python bench/routing_replay.py --quick --no-write   # the tiny widths with its router (CI-sized)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Routing replay (R3): rollout vs trainer mismatch, and its cost"

from bench.receive_in_worker import Loop  # noqa: E402  (a rollout core on an event loop in a thread)


def build_model(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from lorarl.assets.models import (
        EXPERT_INIT_SCALE,
        build_random_model,
        count_parameters,
        init_model,
        save_model,
        shape_config,
    )

    if args.quick:
        return build_random_model("qwen3-moe-tiny-a3b-router", out, seed=3, dtype=torch.float32)
    config = shape_config("qwen3-30b-a3b", num_layers=args.layers)
    model = init_model(config, seed=3, dtype=torch.bfloat16,
                       expert_scale=EXPERT_INIT_SCALE["qwen3-moe-tiny-a3b-router"])
    save_model(model, out)
    return {"parameters": count_parameters(model), "num_layers": config.num_hidden_layers}


def sample(core_loop: Loop, core: Any, prompts: list[tuple[int, ...]], args: argparse.Namespace, seed: int
           ) -> tuple[list[Any], float]:
    """One batch from the engine: (prompt, completion) pairs, and generated tokens per second."""
    from lorarl.rollout.schema import GenerateInput, Sampling

    start = time.perf_counter()
    results = core_loop.call(core.generate(GenerateInput(
        f"bench-{seed}-{time.monotonic_ns()}", tuple(prompts),
        Sampling(n=args.samples, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=seed))))
    seconds = time.perf_counter() - start
    pairs = [(r.prompt_token_ids, c) for r in results for c in r.completions]
    return pairs, sum(len(c.token_ids) for _, c in pairs) / seconds


def rollout(model: Path, prompts: list[tuple[int, ...]], args: argparse.Namespace, record: bool
            ) -> tuple[list[Any], list[float]]:
    """A batch from an engine that records (or does not), and its tokens/s over --reps batches."""
    from lorarl.rollout.config import RolloutSettings
    from lorarl.rollout.factory import start_core

    settings = RolloutSettings(model_path=str(model), engine="vllm", dtype="bfloat16", max_model_len=1024,
                               kv_cache_gib=1.0, record_routes=record, max_num_seqs=len(prompts) * args.samples)
    core_loop = Loop()
    core = core_loop.call(start_core(settings))
    try:
        pairs, _ = sample(core_loop, core, prompts, args, seed=1)  # warm-up, and the batch the trainer reads
        rates = [sample(core_loop, core, prompts, args, seed=2 + r)[1] for r in range(args.reps)]
    finally:
        core_loop.call(core.close())
    return pairs, rates


def run(args: argparse.Namespace) -> list[str]:
    import torch

    from lorarl.rollout.convert import completion as completion_proto
    from lorarl.trainer.engines.api import TrajectoryRecord
    from lorarl.v1 import common_pb2

    tmp = Path(tempfile.mkdtemp(prefix="lorarl-r3-bench-"))
    info = build_model(args, tmp)
    g = torch.Generator().manual_seed(0)
    vocab = 250 if args.quick else 151_000
    prompts = [tuple(int(t) for t in torch.randint(5, vocab, (args.prompt_tokens,), generator=g))
               for _ in range(args.prompts)]
    plain_pairs, plain_rates = rollout(tmp, prompts, args, record=False)
    pairs, record_rates = rollout(tmp, prompts, args, record=True)
    del plain_pairs
    records = [TrajectoryRecord(list(p), list(c.token_ids), list(c.logprobs), [0] * len(c.token_ids), 0.0, f"g{i}",
                                routes=c.routes) for i, (p, c) in enumerate(pairs)]
    bare = [TrajectoryRecord(r.prompt_token_ids, r.completion_token_ids, r.behavior_logprobs, r.token_versions,
                             float(i % 2), r.group_id) for i, r in enumerate(records)]
    for r, b in zip(records, bare, strict=True):
        r.reward = b.reward
    sides = {name: trainer_side(name, str(tmp), bare, records, args.reps) for name in args.engines.split(",")}
    tokens = sum(r.num_tokens for r in records)
    with_routes = sum(completion_proto(c, len(p)).ByteSize() for p, c in pairs)
    without = sum(common_pb2.Trajectory(prompt_token_ids=list(p), completion_token_ids=list(c.token_ids),
                                        behavior_logprobs=list(c.logprobs)).ByteSize() for p, c in pairs)
    route_bytes = with_routes - sum(completion_proto(dataclasses.replace(c, routes=None), len(p)).ByteSize()
                                    for p, c in pairs)
    shape = "tiny widths, 4 layers, 128 experts top-8" if args.quick else \
        f"Qwen3-30B-A3B shape, {args.layers} layers (128 experts top-8, vocabulary 151,936)"
    lines = [
        f"{shape}, {info['parameters'] / 1e6:.0f}M parameters, random init (experts x10); rollout vLLM CPU bf16, "
        f"trainer fp32 ({', '.join(sides)} engine); {args.prompts} prompts x {args.samples} samples x "
        f"{args.tokens} tokens after {args.prompt_tokens}-token prompts.", "",
        "| trainer engine | | trainer routes live | trainer replays the rollout's routes (R3) |",
        "| --- | --- | ---: | ---: |",
    ]
    for name, (live, replayed, live_step, replay_step, _) in sides.items():
        lines += [
            f"| {name} | KL(rollout \\|\\| trainer), k3 | {live['rollout_kl_k3']:.3e} | "
            f"{replayed['rollout_kl_k3']:.3e} |",
            f"| {name} | KL k1 | {live['rollout_kl_k1']:.3e} | {replayed['rollout_kl_k1']:.3e} |",
            f"| {name} | tokens with rho outside [1/2, 2] | {live['rollout_token_past_fraction']:.4f} | "
            f"{replayed['rollout_token_past_fraction']:.4f} |",
            f"| {name} | forward+backward of the batch, median s | {live_step:.3f} | {replay_step:.3f} "
            f"({replay_step / live_step:.2f}x) |",
        ]
    lines.append("")
    for name, (live, replayed, _, _, routing) in sides.items():
        lines.append(
            f"{name}: KL k3 with R3 / without {replayed['rollout_kl_k3'] / live['rollout_kl_k3']:.3f}; its live "
            f"routers would have picked another expert set for {100 * routing.get('routing_disagreement', 0):.1f}% "
            f"of (token, MoE layer) pairs, {100 * routing.get('routing_token_disagreement', 0):.1f}% of tokens in "
            "some layer.")
    return [
        *lines, "",
        "| rollout | generated tokens/s, best of reps |", "| --- | ---: |",
        f"| without recording (prefix caching on) | {max(plain_rates):.1f} |",
        f"| recording routes | {max(record_rates):.1f} ({max(record_rates) / max(plain_rates):.2f}x) |", "",
        f"Routes on the wire: {route_bytes / tokens:.0f} B per token ({route_bytes / 2**20:.2f} MiB for this batch "
        f"of {tokens:,} tokens); the completions' messages grow {with_routes / max(without, 1):.1f}x.",
    ]


def trainer_side(name: str, model: str, bare: list[Any], records: list[Any], reps: int
                 ) -> tuple[dict[str, float], dict[str, float], float, float, dict[str, float]]:
    """One trainer engine on the batch: (mismatch live, mismatch replayed, median forward+backward s live, same
    replaying, the replaying step's routing figures); the engine is freed before the next one is built."""
    import gc

    import torch

    from lorarl.contract.training import CorrectionSpec, TrainingSpec
    from lorarl.trainer.engines.factory import create_engine
    from lorarl.trainer.rl.correction import correct

    gc.collect()  # the previous engine's cycles: two 30B-A3B-shaped engines do not fit at once
    engine = create_engine(TrainingSpec(base_model_path=model, engine=name))

    def mismatch(batch: list[Any]) -> dict[str, float]:
        logprobs = engine.compute_logprobs(batch)
        T = max(len(r.completion_token_ids) for r in batch)
        train, sampler, mask = (torch.zeros(len(batch), T) for _ in range(3))
        for i, (lp, r) in enumerate(zip(logprobs, batch, strict=True)):
            n = len(lp)
            train[i, :n], sampler[i, :n], mask[i, :n] = torch.tensor(lp), torch.tensor(r.behavior_logprobs), 1.0
        return correct(train, sampler, mask, CorrectionSpec()).metrics

    live, replayed = mismatch(bare), mismatch(records)
    step_s: dict[str, list[float]] = {"live": [], "replay": []}
    routing: dict[str, float] = {}
    for rep in range(reps + 1):
        for kind, batch in (("live", bare), ("replay", records)) if rep % 2 == 0 else (("replay", records),
                                                                                          ("live", bare)):
            start = time.perf_counter()
            metrics = engine.forward_backward(batch)
            if rep:
                step_s[kind].append(time.perf_counter() - start)
            engine.optimizer.zero_grad(set_to_none=True)
            if kind == "replay":
                routing = metrics
    engine.close()
    return live, replayed, statistics.median(step_s["live"]), statistics.median(step_s["replay"]), routing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engines", default="torch,megatron", help="trainer engines, comma-separated")
    parser.add_argument("--quick", action="store_true", help="the tiny widths with Qwen3-30B-A3B's router")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.prompt_tokens, args.reps = 24, 8, 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    lines = run(args)
    print("\n".join(lines))
    if not args.no_write:
        from bench.results import write_results

        write_results(HEADING, f"### {'tiny' if args.quick else f'{args.layers} layers'}, {args.prompts}x"
                               f"{args.samples}x{args.tokens} tokens ({time.strftime('%Y-%m-%d')})", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
