"""Where each checkpoint tensor of a co-located job's base lies in the one shared copy (issue "one base").

The shared copy is kept in the rollout engine's layout, because the engine is the side that cannot take views:
vLLM fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (each a row-concatenation, in that
order, at tensor parallel size 1) and pads the vocabulary rows of the embedding and output head to a multiple of
64. Every checkpoint tensor is then a contiguous block of rows of one shared tensor, so the trainer's modules are
plain views of it and neither side holds a copy. This module is the one statement of that mapping: the segment
builder writes by it, the trainer takes its views by it, and the aliasing test proves it against the live engine
(a swapped entry must fail there).

MoE experts are not in it: vLLM stacks them into ``w13``/``w2`` tensors it repacks on CPU, and vLLM CPU cannot
serve MoE LoRA at all, so a co-located MoE job is refused (lorarl.client.job.plan.colocation_refusal).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: The engine's fused projections: each fused tensor is its parts' rows, concatenated in this order.
PACKED: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                     "gate_up_proj": ("gate_proj", "up_proj")}
#: vLLM's VocabParallelEmbedding/ParallelLMHead pad their rows to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Part:
    """A checkpoint tensor as rows ``[start, stop)`` of a shared tensor (all of its other dimensions)."""

    checkpoint: str
    start: int
    stop: int


@dataclass(frozen=True)
class SharedTensor:
    """One tensor of the shared copy: the engine's parameter name and shape, and the checkpoint tensors in it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    parts: tuple[Part, ...]


def _padded(rows: int) -> int:
    return -(-rows // VOCAB_PADDING) * VOCAB_PADDING


def shared_name(checkpoint: str) -> tuple[str, int]:
    """(the shared tensor's name, the part's index in it) for a checkpoint tensor name."""
    module, _, leaf = checkpoint.rpartition(".")
    parent, _, projection = module.rpartition(".")
    for fused, parts in PACKED.items():
        if projection in parts:
            return f"{parent}.{fused}.{leaf}", parts.index(projection)
    return checkpoint, 0


def layout(checkpoint: Mapping[str, tuple[tuple[int, ...], str]], tied: bool) -> list[SharedTensor]:
    """The shared tensors for a checkpoint's tensors (name -> (shape, dtype)), in checkpoint order; ``tied``: the
    output head is the embedding (a tied checkpoint has no ``lm_head.weight`` of its own, or one that is ignored).
    ValueError when a fused projection misses a part or its parts disagree in dtype or columns."""
    grouped: dict[str, dict[int, tuple[str, tuple[int, ...], str]]] = {}
    for name, (shape, dtype) in checkpoint.items():
        if tied and name == "lm_head.weight":
            continue
        target, index = shared_name(name)
        grouped.setdefault(target, {})[index] = (name, tuple(shape), dtype)
    out = []
    for target, pieces in grouped.items():
        fused = next((parts for f, parts in PACKED.items() if f".{f}." in f".{target}"), None)
        expected = len(fused) if fused and target != pieces[min(pieces)][0] else 1
        if sorted(pieces) != list(range(expected)):
            missing = [fused[i] for i in range(expected) if i not in pieces] if fused else []
            raise ValueError(f"{target}: the checkpoint lacks {missing} of the fused projection")
        rows, parts = 0, []
        first = pieces[0]
        for index in range(expected):
            name, shape, dtype = pieces[index]
            if dtype != first[2] or shape[1:] != first[1][1:]:
                raise ValueError(f"{name} ({dtype} {list(shape)}) does not stack with {first[0]} "
                                 f"({first[2]} {list(first[1])})")
            parts.append(Part(name, rows, rows + shape[0]))
            rows += shape[0]
        if target in VOCAB_ROWS:
            rows = _padded(rows)
        out.append(SharedTensor(target, (rows, *first[1][1:]), first[2], tuple(parts)))
    return out
