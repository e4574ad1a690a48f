"""How many bytes a torch-engine train step keeps alive: the formulas the `--dry-run` plan prints and
the engine's ``activation_checkpointing: auto`` decides by. Plain arithmetic on config.json fields.

Activations per token per decoder layer are the bytes autograd saves for backward in a transformers
Qwen3 / Qwen3-MoE layer with lorarl's LoRA on every linear, counted with saved-tensor hooks
(tests/unit/trainer/test_memory.py recounts them on small shapes and holds this model to them). With
b the activation dtype's bytes, H hidden, q/kv the query/key-value widths, I the MLP width, r the
LoRA rank:

    attention   b·(cH·H + cQ·(q + kv)) + 8·heads + 40 + lora      (cH, cQ) = (5, 4) in bf16, (3, 3) in fp32
    dense MLP   b·(H + 4·I) + lora
    MoE MLP     4·experts + top_k·(b·(3·H + 4·I_moe) + 3·b·r)
    lora        b·r per adapted projection in bf16 (the x·Aᵀ product); 0 for fp32 linears, whose
                LoRA runs as one merged matmul that saves only its input

(Qwen3-8B, bf16, rank 32: 184.7 KiB per token per layer.) Checkpointed, a layer keeps only its input
(b·H) and one layer's activations exist at a time, while backward recomputes it. Outside the
layers each token keeps ~b·H (the final norm's output at the LM head). A frozen LM head (every LoRA
job) takes its gradient in closed form (lorarl.trainer.engines.head_logprobs): each token keeps a 4·H
fp32 basis and a chunk of c tokens peaks at 8·c·V in forward (log-softmax and softmax). A head that
trains (full fine-tuning) goes through autograd: unchunked, each token keeps the fp32 log-softmax
(4·V) and backward briefly needs 8·V more; a checkpointed chunk keeps nothing and peaks at 12·c·V
while it is recomputed and differentiated (`logits_bytes`; 2 more bytes per entry for a bf16 head's
own output). The step's peak is the kept bytes plus the larger of the logits transient and one
recomputed layer: the two never overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Bytes beyond the formulas on CPU: the interpreter, torch and transformers once imported (measured by
#: bench/memory_plan.py as the resident set before a step less the weights: 0.41 GiB).
CPU_RUNTIME_BYTES = 420 << 20
#: Share of a micro-batch's full activations that must stay free for "auto" to leave checkpointing off.
AUTO_HEADROOM = 0.5


def dtype_bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def _widths(shape: dict[str, Any]) -> tuple[int, int, int, int]:
    h = shape["hidden_size"]
    heads = shape["num_attention_heads"]
    hd = shape.get("head_dim") or h // heads
    return h, heads, heads * hd, shape["num_key_value_heads"] * hd


def layer_activation_bytes(shape: dict[str, Any], rank: int, dtype: str, adapted: bool = True) -> int:
    """Bytes one decoder layer saves for backward per token (see the module docstring)."""
    b = dtype_bytes(dtype)
    h, heads, q, kv = _widths(shape)
    lora = b * rank if adapted and b == 2 else 0
    c_h, c_q = (5, 4) if b == 2 else (3, 3)
    attention = b * (c_h * h + c_q * (q + kv)) + 8 * heads + 40 + 4 * lora
    experts = shape.get("num_experts") or shape.get("num_local_experts") or 0
    if experts:
        top_k = shape["num_experts_per_tok"]
        inter = shape["moe_intermediate_size"]
        expert_lora = 3 * b * rank if adapted else 0
        mlp = 4 * experts + top_k * (b * (3 * h + 4 * inter) + expert_lora)
    else:
        mlp = b * (h + 4 * shape["intermediate_size"]) + 3 * lora
    return attention + mlp


def logits_bytes(vocab: int, tokens: int, dtype: str, chunked: bool, frozen_head: bool = True) -> int:
    """Peak transient bytes of the LM head and log-softmax over ``tokens`` rows at once, beyond what the
    step keeps. A frozen head's closed form holds the fp32 log-softmax and softmax of one chunk (8 bytes
    per entry), in forward only. Through autograd, a whole micro-batch keeps its fp32 log-softmax for
    backward (counted in the kept activations) and its backward adds the gradients of the log-softmax
    and of the logits (8); a checkpointed chunk keeps nothing, so its recomputed log-softmax joins them
    (12). A bf16 head adds its own output (2). Measured by bench/memory_plan.py."""
    extra = 0 if dtype_bytes(dtype) == 4 else 2
    per_entry = 8 if frozen_head else 12 if chunked else 8
    return tokens * vocab * (per_entry + extra)


@dataclass(frozen=True)
class StepMemory:
    """A train step's peak bytes beyond weights and optimiser state, per trainer device.

    The step peaks either in the LM head's backward (kept + logits) or, with checkpointing, while a
    layer is recomputed and differentiated (kept + recompute); not in both at once.
    """

    tokens: int  # tokens of the largest micro-batch
    kept: int  # saved for backward through the whole backward pass
    recompute: int  # one checkpointed layer's activations, alive while backward recomputes it
    logits: int  # the LM-head chunk's transient tensors
    checkpointing: bool

    @property
    def activations(self) -> int:
        return self.kept + self.recompute

    @property
    def total(self) -> int:
        return self.kept + max(self.recompute, self.logits)

    def split(self, ways: int) -> StepMemory:
        """The same step with the layers' activations split ``ways`` ways (tensor parallel)."""
        return StepMemory(self.tokens, self.kept // ways, self.recompute // ways, self.logits, self.checkpointing)


def step_memory(shape: dict[str, Any], rank: int, dtype: str, tokens: int, checkpointing: bool,
                logits_chunk_tokens: int, layers: int | None = None, adapted: bool = True,
                frozen_head: bool = True) -> StepMemory:
    """Peak activation and logits bytes of one micro-batch of ``tokens`` tokens on one device holding
    ``layers`` decoder layers (default: all of them); ``frozen_head`` False for a head that trains."""
    b = dtype_bytes(dtype)
    n_layers = shape["num_hidden_layers"] if layers is None else layers
    per_layer = layer_activation_bytes(shape, rank, dtype, adapted)
    vocab, hidden = shape["vocab_size"], shape["hidden_size"]
    chunked = 0 < logits_chunk_tokens < tokens
    whole_log_softmax = 0 if frozen_head or chunked else tokens * 4 * vocab  # kept by autograd
    outside = tokens * (b + (4 if frozen_head else 0)) * hidden + whole_log_softmax
    if checkpointing:
        kept, recompute = n_layers * tokens * b * shape["hidden_size"], tokens * per_layer
    else:
        kept, recompute = n_layers * tokens * per_layer, 0
    logits = logits_bytes(vocab, logits_chunk_tokens if chunked else tokens, dtype, chunked, frozen_head)
    return StepMemory(tokens, kept + outside, recompute, logits, checkpointing)


def free_device_bytes(device: Any) -> int:
    """Bytes free on a torch device now: the accelerator's own count, or the host's MemAvailable on CPU."""
    kind = getattr(device, "type", str(device))
    if kind in ("cuda", "npu"):
        import torch

        if kind == "npu":
            from lorarl.platform import load_npu

            load_npu()  # registers torch.npu
        free, _ = getattr(torch, kind).mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def needs_checkpointing(shape: dict[str, Any], rank: int, dtype: str, tokens: int, logits_chunk_tokens: int,
                        free_bytes: int, layers: int | None = None, frozen_head: bool = True) -> bool:
    """"auto": checkpoint when a micro-batch's unchecked step would take more than AUTO_HEADROOM of what
    is free on the device once weights and optimiser state are in place."""
    plain = step_memory(shape, rank, dtype, tokens, False, logits_chunk_tokens, layers, frozen_head=frozen_head)
    return plain.total > AUTO_HEADROOM * free_bytes


def stage_sizes(outside: float, per_layer: Sequence[float], stages: int) -> list[int]:
    """Layers per device (contiguous, in order, at least one each) that minimise the largest device's
    bytes, the first device also holding ``outside`` (embeddings, norm, head)."""
    if not 1 <= stages <= len(per_layer):
        raise ValueError(f"cannot split {len(per_layer)} decoder layers across {stages} devices")

    def pack(limit: float) -> list[int]:
        """Fills each device up to ``limit`` before opening the next."""
        sizes, load = [0], outside
        for size in per_layer:
            if sizes[-1] and load + size > limit:
                sizes.append(0)
                load = 0.0
            sizes[-1] += 1
            load += size
        return sizes

    low, high = max(outside + per_layer[0], *per_layer), outside + sum(per_layer)  # pack(high): one device
    for _ in range(100):  # bisect the smallest limit that packs into ``stages`` devices
        if high - low <= 1e-6 * high:
            break
        mid = (low + high) / 2
        low, high = (low, mid) if len(pack(mid)) <= stages else (mid, high)
    sizes = pack(high)
    while len(sizes) < stages:  # a spare device takes the last layer of the last run that has two or more
        at = max(i for i, n in enumerate(sizes) if n > 1)
        sizes[at:at + 1] = [sizes[at] - 1, 1]
    return sizes
