"""Merging a LoRA adapter into base weights on the receiving side (local merge).

A late joiner of a MERGED job, or a replica that cannot run LoRA, is sent the small adapter and
builds the merged weights itself from the base weights it already holds: tens of MB on the wire
instead of the whole model, and the service only ever stores adapters. The arithmetic is the one
merge (lorarl.contract.merge), so the result is bit-identical to the trainer's merged tensor for the
same base and scale. Always merge into the pristine base, never into a previously merged weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from lorarl.contract.lora import LoraSpec
from lorarl.contract.merge import merge_lora
from lorarl.contract.peft import pair_tensors


def merged_from_adapter(adapter: Mapping[str, torch.Tensor], lora: LoraSpec,
                        base_weight: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, merged weight) for every adapted module; `base_weight(name)` returns the pristine base."""
    scale = lora.scale
    for module, (a, b) in pair_tensors(adapter).items():
        name = f"{module}.weight"
        yield name, merge_lora(base_weight(name), a, b, scale)
