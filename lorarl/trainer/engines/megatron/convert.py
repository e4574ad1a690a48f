"""Hugging Face Qwen3 / Qwen3-MoE <-> megatron-core GPT: config, state dict names and layouts, TP/EP/PP shards.

The one place that knows both layouts, so the model builder, LoRA export and checkpoints agree.
Megatron layouts used (megatron-core's standard ones, local spec):

* ``self_attention.linear_qkv.weight``: per KV group ``[q heads of the group; k; v]`` (rows
  ``(heads/groups + 2) * head_dim`` per group), groups stacked; TP splits whole groups.
* ``mlp.linear_fc1.weight`` (and per expert): ``[gate; up]``; each TP rank holds ``[gate_r; up_r]``.
* column-parallel (qkv, fc1) split dim 0, row-parallel (linear_proj, fc2) split dim 1.
* vocabulary (embedding, output layer): split dim 0 after zero-padding the vocabulary to a multiple
  of tp (megatron needs even vocab shards); gathering drops the padding rows again. Padded rows
  produce logits that callers must slice off (`model.compute_logits` does).
* experts: ``mlp.experts.local_experts.{i}``; EP rank r owns global experts
  ``[r * E/ep, (r+1) * E/ep)`` and names them by local index; expert TP size equals tp.
* pipeline: stage s owns layers ``[s * L/pp, (s+1) * L/pp)`` under local indices; the embedding
  lives on the first stage, the final norm and output layer on the last (tied embeddings with pp > 1
  keep a copy of the embedding as ``output_layer.weight`` there, as megatron does).

HF state dicts are accepted in checkpoint names (per-expert ``mlp.experts.{e}.gate_proj.weight``)
or in transformers >= 5 in-memory names (fused ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I]); HF output is always checkpoint names, what safetensors files and vLLM use.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from lorarl.trainer.engines.megatron.parallel import ParallelSettings

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "linear_fc1.weight")
ROW_PARALLEL = ("self_attention.linear_proj.weight", "linear_fc2.weight")
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Qwen3Layout:
    """The shape facts of a Qwen3 (dense or MoE) checkpoint that conversion and sharding need."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def layout_from_hf(hf_config: Mapping[str, Any] | Any) -> Qwen3Layout:
    """A transformers config (object or config.json dict) -> Qwen3Layout; rejects what the conversion cannot express."""
    c = dict(hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict())
    if c.get("model_type") not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"megatron engine supports model_type qwen3 and qwen3_moe, got {c.get('model_type')!r}")
    if c.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported by the megatron Qwen3 conversion")
    if c.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported by the megatron Qwen3 conversion")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    num_layers = c["num_hidden_layers"]
    num_heads = c["num_attention_heads"]
    experts = c.get("num_experts", c.get("num_local_experts", 0)) if c["model_type"] == "qwen3_moe" else 0
    moe_layers: tuple[bool, ...] = ()
    if experts:
        step, dense_only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
        moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    return Qwen3Layout(
        num_layers=num_layers, hidden_size=c["hidden_size"], num_heads=num_heads,
        num_kv_heads=c.get("num_key_value_heads") or num_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // num_heads, ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"], tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        rms_norm_eps=c["rms_norm_eps"], rope_theta=float(theta),
        max_position_embeddings=c["max_position_embeddings"], num_experts=experts,
        moe_ffn_hidden_size=c.get("moe_intermediate_size", 0) if experts else 0,
        moe_topk=c.get("num_experts_per_tok", 0) if experts else 0,
        norm_topk_prob=bool(c.get("norm_topk_prob", True)), moe_layers=moe_layers,
    )


def transformer_config(layout: Qwen3Layout, parallel: ParallelSettings, dtype: torch.dtype = torch.float32,
                       device: str = "cpu") -> TransformerConfig:
    """The megatron TransformerConfig computing what transformers' Qwen3 / Qwen3-MoE computes.

    Routing: HF takes softmax over all experts, top-k, then renormalises when norm_topk_prob;
    megatron's softmax *after* top-k (moe_router_pre_softmax=False) is exactly that renormalised
    form, and pre-softmax top-k is the unnormalised one. No aux loss (the router is frozen here).
    The allgather token dispatcher is used because the all-to-all one needs CUDA streams. On CPU,
    parameters are allocated on the host and pipeline sends skip their ``torch.cuda.synchronize``.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    moe: dict[str, Any] = {}
    if layout.num_experts:
        moe = dict(num_moe_experts=layout.num_experts, moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
                   moe_router_topk=layout.moe_topk, moe_router_pre_softmax=not layout.norm_topk_prob,
                   moe_router_score_function="softmax", moe_router_load_balancing_type="none",
                   moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                   moe_layer_freq=[int(m) for m in layout.moe_layers], moe_shared_expert_intermediate_size=None,
                   moe_router_dtype="fp32")
    return TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size, num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads, kv_channels=layout.head_dim, ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=layout.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep, sequence_parallel=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype, use_cpu_initialization=device == "cpu", batch_p2p_sync=device != "cpu",
        perform_initialization=False, **moe,
    )


# --- fused layouts -------------------------------------------------------------------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Qwen3Layout) -> torch.Tensor:
    """HF q [heads*hd, ...], k/v [groups*hd, ...] -> megatron linear_qkv rows, grouped per KV group."""
    groups = k.shape[0] // layout.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(groups, layout.heads_per_group * layout.head_dim, *rest),
             k.reshape(groups, layout.head_dim, *rest), v.reshape(groups, layout.head_dim, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, layout: Qwen3Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv along dim 0; works on a TP shard too (it holds whole groups) and on LoRA B [rows, r]."""
    q_rows, hd = layout.heads_per_group * layout.head_dim, layout.head_dim
    per_group = q_rows + 2 * hd
    if fused.shape[0] % per_group:
        raise ValueError(f"{fused.shape[0]} qkv rows are not whole KV groups of {per_group} rows")
    rest = fused.shape[1:]
    grouped = fused.reshape(fused.shape[0] // per_group, per_group, *rest)
    q, k, v = grouped.split([q_rows, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_fc1(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron linear_fc1 [gate; up] (dim 0) -> (gate, up); also valid on a TP shard and on LoRA B."""
    gate, up = fused.chunk(2, dim=0)
    return gate, up


# --- HF <-> megatron state dicts --------------------------------------------------------------------------------

def _unfuse_hf_experts(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 in-memory expert tensors -> checkpoint names per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """A full HF state dict -> the full (unsharded, pp=1) megatron GPTModel state dict; every tensor must be used."""
    hf = _unfuse_hf_experts(hf_state)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"HF state dict lacks {name}")
        used.add(name)
        return hf[name]

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": take("model.norm.weight")}
    if layout.tied_embeddings:
        used.add("lm_head.weight")  # transformers may list the tied copy; megatron shares the embedding
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    for i in range(layout.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[f"{mp}input_layernorm.weight"] = take(f"{hp}input_layernorm.weight")
        out[f"{mp}self_attention.linear_qkv.weight"] = fuse_qkv(
            take(f"{hp}self_attn.q_proj.weight"), take(f"{hp}self_attn.k_proj.weight"),
            take(f"{hp}self_attn.v_proj.weight"), layout)
        out[f"{mp}self_attention.q_layernorm.weight"] = take(f"{hp}self_attn.q_norm.weight")
        out[f"{mp}self_attention.k_layernorm.weight"] = take(f"{hp}self_attn.k_norm.weight")
        out[f"{mp}self_attention.linear_proj.weight"] = take(f"{hp}self_attn.o_proj.weight")
        out[f"{mp}pre_mlp_layernorm.weight"] = take(f"{hp}post_attention_layernorm.weight")
        if layout.is_moe_layer(i):
            out[f"{mp}mlp.router.weight"] = take(f"{hp}mlp.gate.weight")
            for e in range(layout.num_experts):
                he, me = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{e}."
                out[f"{me}linear_fc1.weight"] = fuse_fc1(take(f"{he}gate_proj.weight"), take(f"{he}up_proj.weight"))
                out[f"{me}linear_fc2.weight"] = take(f"{he}down_proj.weight")
        else:
            out[f"{mp}mlp.linear_fc1.weight"] = fuse_fc1(take(f"{hp}mlp.gate_proj.weight"),
                                                         take(f"{hp}mlp.up_proj.weight"))
            out[f"{mp}mlp.linear_fc2.weight"] = take(f"{hp}mlp.down_proj.weight")
    unused = sorted(hf.keys() - used)
    if unused:
        raise ValueError(f"HF state dict has tensors the Qwen3 layout does not use: {unused[:5]}")
    return out


def megatron_to_hf(mcore_state: Mapping[str, torch.Tensor], layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """The full (gathered, pp=1 names) megatron state dict -> HF checkpoint names (per-expert tensors)."""
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": mcore_state["embedding.word_embeddings.weight"],
                                    "model.norm.weight": mcore_state["decoder.final_layernorm.weight"]}
    if not layout.tied_embeddings:
        out["lm_head.weight"] = mcore_state["output_layer.weight"]
    for name, t in mcore_state.items():
        m = _LAYER.fullmatch(name)
        if m:
            out.update(layer_to_hf(f"model.layers.{m[1]}.", m[2], t, layout))
    return out


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def layer_to_hf(hp: str, rest: str, t: torch.Tensor, layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """One full (gathered) layer tensor ``decoder.layers.N.<rest>`` -> its HF tensor(s) under prefix hp."""
    if rest in _HF_LAYER_NAMES:
        return {hp + _HF_LAYER_NAMES[rest]: t}
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(t, layout)
        return {f"{hp}self_attn.q_proj.weight": q, f"{hp}self_attn.k_proj.weight": k,
                f"{hp}self_attn.v_proj.weight": v}
    if rest == "mlp.linear_fc1.weight":
        gate, up = split_fc1(t)
        return {f"{hp}mlp.gate_proj.weight": gate, f"{hp}mlp.up_proj.weight": up}
    m = _EXPERT.fullmatch(rest)
    if m and m[2] == "linear_fc1.weight":
        gate, up = split_fc1(t)
        return {f"{hp}mlp.experts.{m[1]}.gate_proj.weight": gate, f"{hp}mlp.experts.{m[1]}.up_proj.weight": up}
    if m and m[2] == "linear_fc2.weight":
        return {f"{hp}mlp.experts.{m[1]}.down_proj.weight": t}
    raise KeyError(f"no HF name for megatron tensor decoder.layers.N.{rest}")


_layer_to_hf = layer_to_hf  # the name lorarl/trainer/engines/megatron/export.py still calls


# --- sharding over TP / EP / PP ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankCoords:
    """Where one process sits in megatron's grid (only what decides its shard)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @classmethod
    def current(cls) -> RankCoords:
        """This process's coordinates from megatron's parallel_state."""
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The smallest multiple of tp_size >= vocab_size (megatron splits the vocabulary evenly)."""
    return -(-vocab_size // tp_size) * tp_size


def tp_partition_dim(name: str) -> int | None:
    """0 for column- and vocab-parallel tensors, 1 for row-parallel ones, None if replicated over TP."""
    if name.endswith(COLUMN_PARALLEL) or name in VOCAB_PARALLEL:
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def tp_shard(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full megatron tensor (fc1 keeps [gate_r; up_r]; vocab padded with zero rows)."""
    dim = tp_partition_dim(name)
    if dim is None or tp_size == 1:
        return tensor
    if name in VOCAB_PARALLEL:
        pad = padded_vocab_size(tensor.shape[0], tp_size) - tensor.shape[0]
        if pad:
            tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
    if name.endswith("linear_fc1.weight"):
        gate, up = split_fc1(tensor)
        return fuse_fc1(gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]).contiguous()
    return tensor.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def tp_merge(name: str, shards: list[torch.Tensor], vocab_size: int | None = None) -> torch.Tensor:
    """Inverse of tp_shard given every TP rank's shard in rank order; vocab_size drops vocabulary padding."""
    dim = tp_partition_dim(name)
    if dim is None:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(split_fc1(s) for s in shards), strict=True)
        return fuse_fc1(torch.cat(gates), torch.cat(ups))
    full = torch.cat(shards, dim=dim)
    return full[:vocab_size] if name in VOCAB_PARALLEL and vocab_size is not None else full


def _stage_layers(layout: Qwen3Layout, pp_rank: int, pp_size: int) -> range:
    per = layout.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def local_name(name: str, layout: Qwen3Layout, coords: RankCoords) -> str | None:
    """The name a full-model tensor has on this rank, or None when the rank does not hold it."""
    first, last = coords.pp_rank == 0, coords.pp_rank == coords.pp_size - 1
    if name == "embedding.word_embeddings.weight":
        return name if first else None
    if name in ("decoder.final_layernorm.weight", "output_layer.weight"):
        return name if last else None
    m = _LAYER.fullmatch(name)
    if not m:
        raise KeyError(f"unknown megatron tensor {name}")
    layers = _stage_layers(layout, coords.pp_rank, coords.pp_size)
    layer, rest = int(m[1]), m[2]
    if layer not in layers:
        return None
    e = re.fullmatch(r"(mlp\.experts\.local_experts\.)(\d+)(\..+)", rest)
    if e:
        per = layout.num_experts // coords.ep_size
        expert = int(e[2])
        if expert // per != coords.ep_rank:
            return None
        rest = f"{e[1]}{expert % per}{e[3]}"
    return f"decoder.layers.{layer - layers.start}.{rest}"


def global_name(name: str, layout: Qwen3Layout, coords: RankCoords) -> str:
    """Inverse of local_name: a rank's tensor name -> its full-model name."""
    m = _LAYER.fullmatch(name)
    if not m:
        return name
    layer, rest = int(m[1]) + _stage_layers(layout, coords.pp_rank, coords.pp_size).start, m[2]
    e = re.fullmatch(r"(mlp\.experts\.local_experts\.)(\d+)(\..+)", rest)
    if e:
        rest = f"{e[1]}{int(e[2]) + coords.ep_rank * (layout.num_experts // coords.ep_size)}{e[3]}"
    return f"decoder.layers.{layer}.{rest}"


def shard_for_rank(name: str, tensor: torch.Tensor, layout: Qwen3Layout,
                   coords: RankCoords) -> tuple[str, torch.Tensor] | None:
    """(local name, this rank's slice) of one full-model tensor, or None when the rank does not hold it."""
    local = local_name(name, layout, coords)
    if local is None:
        return None
    return local, tp_shard(name, tensor, coords.tp_rank, coords.tp_size)


def shard_state(mcore_state: Mapping[str, torch.Tensor], layout: Qwen3Layout,
                coords: RankCoords) -> dict[str, torch.Tensor]:
    """This rank's state dict; a tied embedding is also the last pipeline stage's output_layer.weight (pp > 1)."""
    state = dict(mcore_state)
    if layout.tied_embeddings and coords.pp_size > 1:
        state["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        placed = shard_for_rank(name, tensor, layout, coords)
        if placed is not None:
            out[placed[0]] = placed[1]
    return out


def gather_states(states: Mapping[RankCoords, Mapping[str, torch.Tensor]],
                  layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """Every rank's state dict (keyed by its coords) -> the full megatron state dict (inverse of shard_state)."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for coords, state in states.items():
        for name, tensor in state.items():
            full = global_name(name, layout, coords)
            pieces.setdefault(full, {})[coords.tp_rank] = tensor
    if layout.tied_embeddings:
        pieces.pop("output_layer.weight", None)
    out = {}
    for name, by_rank in pieces.items():
        ranks = sorted(by_rank)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"{name}: missing tensor-parallel shards, have ranks {ranks}")
        out[name] = tp_merge(name, [by_rank[r] for r in ranks], layout.vocab_size)
    return out
