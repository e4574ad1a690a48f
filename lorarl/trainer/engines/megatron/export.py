"""Megatron LoRA -> what the rollout loads: PEFT adapters (mode 1) and merged HF weights (mode 2).

PEFT mapping (the exact tensors TorchEngine's ``peft_state_dict`` writes for the same adapter):

* ``linear_qkv``: lora_B [(q + k + v rows per KV group) * groups, r] is split back per GQA group into
  q_proj / k_proj / v_proj (``convert.split_qkv``); the one lora_A they share is written to all three.
* ``linear_fc1``: lora_B [gate; up] -> gate_proj / up_proj; lora_A duplicated.
* ``linear_proj`` -> o_proj, ``linear_fc2`` -> down_proj (as they are).
* experts ``local_experts.{e}`` (global index) -> ``mlp.experts.{e}.{gate,up,down}_proj``; a shared
  expert adapter is written once per expert, as the torch engine does.

Merged export gathers one layer at a time (TP shards, then EP experts; pipeline stages take turns), adds
``scale * B @ A`` in fp32, casts back to the model dtype and renames through `convert`, so nothing beyond
one layer is whole.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from lorarl.contract.merge import merge_lora
from lorarl.contract.peft import tensor_name, write_peft_files
from lorarl.trainer.engines.checkpoint import atomic_directory
from lorarl.trainer.engines.export import HF_SIDE_FILES, adapted_module_names
from lorarl.trainer.engines.megatron import convert
from lorarl.trainer.engines.megatron.lora import MegatronLora
from lorarl.trainer.engines.plain_collectives import broadcast_tensors
from lorarl.trainer.rl.lora import LoraConfig

_ADAPTER = re.compile(r"decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\.linear_proj|"
                      r"mlp\.linear_fc1|mlp\.linear_fc2|mlp\.experts\.(?:local_experts\.(\d+)|shared)\.(linear_fc[12]))"
                      r"\.lora_([AB])")
_EXPERT_WEIGHT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.\d+\.(linear_fc[12])")


def peft_tensors(full: dict[str, torch.Tensor], layout: convert.Qwen3Layout) -> dict[str, torch.Tensor]:
    """Full megatron adapter tensors (`MegatronLora.full_tensors`) -> PEFT names and layouts."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(full):
        m = _ADAPTER.fullmatch(name)
        if m is None:
            raise KeyError(f"no PEFT name for megatron adapter tensor {name}")
        layer, module, expert, expert_leaf, which = m.groups()
        t = full[name]
        hp = f"model.layers.{layer}."
        if module == "self_attention.linear_qkv":
            names = [f"{hp}self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
            parts = convert.split_qkv(t, layout) if which == "B" else (t, t, t)
        elif module == "self_attention.linear_proj":
            names, parts = [f"{hp}self_attn.o_proj"], (t,)
        elif module in ("mlp.linear_fc1", "mlp.linear_fc2"):
            names = [f"{hp}mlp.{p}" for p in (("gate_proj", "up_proj") if module.endswith("fc1") else ("down_proj",))]
            parts = (convert.split_fc1(t) if which == "B" else (t, t)) if module.endswith("fc1") else (t,)
        else:
            experts = [int(expert)] if expert is not None else range(layout.num_experts)
            projs = ("gate_proj", "up_proj") if expert_leaf == "linear_fc1" else ("down_proj",)
            split = convert.split_fc1(t) if which == "B" and expert_leaf == "linear_fc1" else (t,) * len(projs)
            names = [f"{hp}mlp.experts.{e}.{p}" for e in experts for p in projs]
            parts = tuple(split) * len(experts)
        for peft_name, part in zip(names, parts, strict=True):
            out[tensor_name(peft_name, which)] = part.contiguous().clone()
    return out


def save_peft(tensors: dict[str, torch.Tensor], lora: LoraConfig, base_model_name: str, out_dir: str | Path,
              dtype: torch.dtype = torch.float32) -> Path:
    """adapter_config.json + adapter_model.safetensors, written to a temp dir and renamed into place;
    ``base_model_name``: the base as PEFT is to find it (TrainingSpec.base_model_name_or_path)."""
    final = Path(out_dir)
    with atomic_directory(final) as tmp:
        data = {k: v.to(dtype).contiguous().cpu() for k, v in tensors.items()}
        write_peft_files(tmp, data, lora.peft_config(base_model_name, adapted_module_names(data)))
    return final


def save_merged(weights: Iterator[tuple[str, torch.Tensor]], base_model_path: str | Path,
                out_dir: str | Path) -> Path:
    """The merged policy as an HF checkpoint (config and tokenizer copied from the base)."""
    final = Path(out_dir)
    tensors = {name: t.contiguous().cpu().clone() for name, t in weights}
    with atomic_directory(final) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        base = Path(base_model_path)
        for name in HF_SIDE_FILES:
            if (base / name).exists():
                shutil.copy2(base / name, tmp / name)
    return final


# ---------------------------------------------------------------- merged weights, streamed layer by layer


def _gather_tensor(local: str, tensor: torch.Tensor, layout: convert.Qwen3Layout,
                   coords: convert.RankCoords) -> dict[str, torch.Tensor]:
    """Full-model name -> full tensor(s) for one of this rank's base tensors (collective over TP, then EP)."""
    from megatron.core import parallel_state as ps

    expert = ".local_experts." in local
    name = convert.global_name(local, layout, coords)
    if convert.tp_partition_dim(name) is not None and coords.tp_size > 1:
        group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, tensor.detach().contiguous(), group=group)
        tensor = convert.tp_merge(name, shards, layout.vocab_size)
    elif name in convert.VOCAB_PARALLEL:
        tensor = tensor[: layout.vocab_size]
    if not (expert and coords.ep_size > 1):
        return {name: tensor.detach()}
    peers = [torch.empty_like(tensor) for _ in range(coords.ep_size)]
    dist.all_gather(peers, tensor.detach().contiguous(), group=ps.get_expert_model_parallel_group())
    out = {}
    for r, t in enumerate(peers):
        peer = convert.RankCoords(coords.tp_rank, coords.tp_size, coords.pp_rank, coords.pp_size, r, coords.ep_size)
        out[convert.global_name(local, layout, peer)] = t
    return out


def _merged(name: str, weight: torch.Tensor, adapters: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` in fp32, cast back, when ``name`` carries an adapter; else W."""
    module = name.removesuffix(".weight")
    if f"{module}.lora_A" not in adapters:
        shared = _EXPERT_WEIGHT.fullmatch(module)
        module = f"{shared[1]}.shared.{shared[2]}" if shared else module
    if f"{module}.lora_A" not in adapters:
        return weight
    return merge_lora(weight, adapters[f"{module}.lora_A"], adapters[f"{module}.lora_B"], scale)


def _layer_index(local: str) -> int | None:
    m = re.match(r"decoder\.layers\.(\d+)\.", local)
    return int(m[1]) if m else None


def iter_hf_weights(model: nn.Module, layout: convert.Qwen3Layout, lora: MegatronLora | None = None,
                    scale: float = 1.0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight in HF checkpoint names, layer by layer, adapters merged when ``lora`` is given.

    A collective: every rank of the model-parallel group must iterate it to the end (all get the same
    tensors). With pp > 1 the stages take turns, in order, each broadcasting its layers one at a time
    over the pipeline group. The trained base itself is never modified.
    """
    from megatron.core import parallel_state as ps

    coords = convert.RankCoords.current()
    adapters = lora.full_tensors() if lora is not None else {}  # a collective over every stage
    chunks = _stage_chunks(model, layout, coords, adapters, scale)
    if coords.pp_size == 1:
        for chunk in chunks:
            yield from chunk
        return
    group, stage_ranks = ps.get_pipeline_model_parallel_group(), dist.get_process_group_ranks(
        ps.get_pipeline_model_parallel_group())
    for stage, src in enumerate(stage_ranks):
        while True:  # the stage's chunks, then None
            chunk = next(chunks, None) if stage == coords.pp_rank else None
            received = broadcast_tensors(chunk, src, group)
            if received is None:
                break
            yield from received


def _stage_chunks(model: nn.Module, layout: convert.Qwen3Layout, coords: convert.RankCoords,
                  adapters: dict[str, torch.Tensor], scale: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """This stage's HF weights, one list per layer (the embedding and the tail on their own)."""
    params = [(n, p) for n, p in model.named_parameters() if ".lora" not in n]
    by_layer: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for n, p in params:
        if _layer_index(n) is not None:
            by_layer.setdefault(_layer_index(n), []).append((n, p))
    head = [(n, p) for n, p in params if n == "embedding.word_embeddings.weight"]
    tail = [(n, p) for n, p in params if _layer_index(n) is None and n != "embedding.word_embeddings.weight"]
    for n, p in head:
        yield [("model.embed_tokens.weight", _gather_tensor(n, p, layout, coords)[n])]
    for layer in sorted(by_layer):
        full: dict[str, torch.Tensor] = {}
        for n, p in by_layer[layer]:
            full.update(_gather_tensor(n, p, layout, coords))
        chunk: list[tuple[str, torch.Tensor]] = []
        for name in sorted(full, key=_hf_order):
            m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
            weight = _merged(name, full[name], adapters, scale)
            chunk += convert.layer_to_hf(f"model.layers.{m[1]}.", m[2], weight, layout).items()
        yield chunk
    for n, p in tail:
        t = _gather_tensor(n, p, layout, coords)[n]
        if n == "decoder.final_layernorm.weight":
            yield [("model.norm.weight", t)]
        elif n == "output_layer.weight" and not layout.tied_embeddings:
            yield [("lm_head.weight", t)]


def _hf_order(name: str) -> tuple[int, str]:
    """Experts in numeric order (so the stream reads like an HF checkpoint), everything else by name."""
    m = re.search(r"local_experts\.(\d+)\.", name)
    return (int(m[1]) if m else -1, name)
