"""How long a step's training and generation should take on the planned devices, from FLOPs and bytes.

A first-order estimate for `--dry-run`, to size the trainer against the rollout fleet before any
device is booked (the two halves of an RL step should take about as long: the slower one idles the
other). Rates are fractions of the device's peak that well-tuned runs reach; real runs land within a
factor of ~2 either way, which is the resolution the imbalance flag needs:

    train     2 · active params · step tokens · passes  /  (trainer devices · peak · TRAIN_MFU)
              passes: forward + backward through the activations (the frozen base needs no weight
              gradients) + one recomputed forward with activation checkpointing + a reference pass for KL
    generate  per replica: prefill (2 · active · prompt tokens at PREFILL_MFU) + max_tokens decode
              steps per wave of concurrent sequences (as many as the KV cache holds), each bound by
              the larger of its FLOPs (2 · active · sequences at DECODE_MFU) and its bytes (the
              weights plus the sequences' KV cache, read once, at BANDWIDTH_SHARE of the bandwidth)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

TRAIN_MFU = 0.4
PREFILL_MFU = 0.5
DECODE_MFU = 0.3
BANDWIDTH_SHARE = 0.7
#: Beyond this ratio of the slower half to the faster one, the plan flags the step as unbalanced.
IMBALANCE = 2.0


@dataclass(frozen=True)
class StepTime:
    train_s: float
    generate_s: float
    concurrency: int  # sequences a replica decodes at once
    waves: int  # rounds of concurrent sequences per replica per step

    @property
    def ratio(self) -> float:
        """The slower half over the faster one (>= 1)."""
        slow, fast = max(self.train_s, self.generate_s), min(self.train_s, self.generate_s)
        return slow / fast if fast > 0 else math.inf


def active_parameters(shape: dict[str, Any], counts: dict[str, int]) -> float:
    """Parameters one token's forward multiplies by: experts count top_k of every layer's experts."""
    experts = counts.get("experts") or 0
    if not experts:
        return float(counts["base"] - counts.get("vision", 0))
    top_k = shape.get("num_experts_per_tok") or 1
    dense = counts["base"] - counts.get("vision", 0) - counts["expert_params"]
    return dense + counts["expert_params"] * top_k / experts


def estimate(cfg, shape: dict[str, Any], counts: dict[str, int], checkpointing: bool, kv_bytes_per_token: float,
             tflops: float, bandwidth_gbs: float) -> StepTime:
    """Train and generate seconds of one step of ``cfg`` on devices of ``tflops`` (dense, the job's dtype)
    and ``bandwidth_gbs``; ``kv_bytes_per_token`` is one replica's (already split by its TP)."""
    active = active_parameters(shape, counts)
    peak, bandwidth = tflops * 1e12, bandwidth_gbs * 1e9
    prompt, completion = cfg.data.max_prompt_tokens, cfg.rollout.max_tokens
    sequences = cfg.loop.prompts_per_step * cfg.rollout.group_size
    passes = 2 + int(checkpointing) + int(cfg.trainer.loss.kl_coef > 0)
    par = cfg.trainer.parallel
    # A torch layer split computes on one of its devices at a time.
    trainer_devices = par.world_size // (par.pipeline if cfg.trainer.engine == "torch" else 1)
    train_s = 2 * active * sequences * (prompt + completion) * passes / (trainer_devices * peak * TRAIN_MFU)

    tp = cfg.rollout.tensor_parallel_size
    per_replica = -(-sequences // cfg.rollout.replicas)
    fits = int(cfg.rollout.kv_cache_gib * 2**30 // max(kv_bytes_per_token * (prompt + completion), 1))
    concurrency = max(1, min(per_replica, fits, cfg.rollout.max_num_seqs or per_replica))
    waves = -(-per_replica // concurrency)
    weight_bytes = counts["base"] * (2 if cfg.model.dtype == "bfloat16" else 4) / tp
    mean_context = prompt + completion / 2
    decode_flops = 2 * active * concurrency / tp
    decode_bytes = weight_bytes + concurrency * mean_context * kv_bytes_per_token
    decode_s = max(decode_flops / (peak * DECODE_MFU), decode_bytes / (bandwidth * BANDWIDTH_SHARE))
    prefill_s = 2 * active * per_replica * prompt / (tp * peak * PREFILL_MFU)
    return StepTime(train_s, prefill_s + waves * completion * decode_s, concurrency, waves)
