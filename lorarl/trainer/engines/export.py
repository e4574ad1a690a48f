"""Writes a trained policy to disk: the adapter in PEFT format, or the merged model in HF format."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from lorarl.contract.lora import LINEAR_TARGETS, LoraSpec
from lorarl.contract.peft import adapted_leaves, write_peft_files
from lorarl.trainer.rl.lora import AdapterSlot, iter_merged_weights, peft_state_dict

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def adapted_module_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Leaf module names (q_proj, in_proj_qkv, ...) that carry adapters, for target_modules."""
    return adapted_leaves(tensors, LINEAR_TARGETS)


def _atomic_dir(final: Path) -> Path:
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def save_peft_adapter(model: nn.Module, lora: LoraSpec, base_model_name: str, out_dir: str | Path,
                      dtype: torch.dtype = torch.float32, slot: AdapterSlot | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors (``slot``'s adapters, default the attached ones),
    written to a temp dir then renamed; ``base_model_name``: the base as PEFT is to find it
    (TrainingSpec.base_model_name_or_path)."""
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _atomic_dir(final)
    tensors = {k: v.to(dtype).contiguous().cpu() for k, v in peft_state_dict(model, slot).items()}
    write_peft_files(tmp, tensors, lora.peft_config(base_model_name, adapted_module_names(tensors)))
    _publish_dir(tmp, final)
    return final


def save_merged_model(model: nn.Module, base_model_path: str | Path, out_dir: str | Path,
                      slot: AdapterSlot | None = None) -> Path:
    """The merged policy (``slot``'s adapters, default the attached ones) as an HF checkpoint (config and
    tokenizer copied from the base)."""
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _atomic_dir(final)
    tensors = {name: t.contiguous().cpu().clone() for name, t in iter_merged_weights(model, slot=slot)}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    base = Path(base_model_path)
    for name in HF_SIDE_FILES:
        if (base / name).exists():
            shutil.copy2(base / name, tmp / name)
    _publish_dir(tmp, final)
    return final
