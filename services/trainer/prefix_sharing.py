"""Shared-prompt forward: each distinct prompt of a micro-batch runs through the decoder once.

A GRPO group is n completions of one prompt, so the plain forward (every row's prompt+completion)
computes each prompt n times; on the demo that is 79% of a train step's tokens. Here the distinct
prompts run once, batched and right-padded, with grad and a KV cache; each row's completion then
runs attending to its prompt's cached keys/values (repeated per row by index_select, so gradients of
every row flow back into the one prompt pass), at the real positions P, P+1, ... (RoPE).

    prompt pass      [G, Pmax]   p0 .. pP-1 pad           -> hidden, KV cache
    completion pass  [B, T-1]    c0 .. cC-2 pad           keys: its prompt's cache ++ its own, causally
    2D key mask      [B, Pmax+T-1]  1 on the prompt's real tokens and the real completion inputs

The hidden state predicting each completion token is taken where the plain path takes it
(``target_positions``): in the prompt pass for the first token, in the completion pass for the rest.
Exact up to float rounding (dense and MoE: routing is per token). Only for decoders whose cache is
per-position K/V over full attention (Qwen3, Qwen3-MoE without a sliding window): sliding windows
index cache slots rather than positions, and linear-attention layers (Qwen3.5) cache a recurrent state.
With LoRA dropout on, a group's prompt tokens share one dropout draw instead of one per completion
(same expectation; not bitwise the plain path's draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from services.trainer.batching import PackedBatch

#: Model types whose decoder this module was checked against (full attention, per-position K/V cache).
SHARED_PREFIX_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})


@dataclass(frozen=True)
class PrefixPlan:
    """Which distinct prompt each row of a PackedBatch continues."""

    prompt_ids: torch.Tensor  # [G, Pmax] long, right-padded distinct prompts, in order of first appearance
    prompt_lengths: torch.Tensor  # [G] long
    row_prompt: torch.Tensor  # [B] long, index into G

    @property
    def prompts(self) -> int:
        return self.prompt_ids.shape[0]


def supports_prefix_sharing(model: nn.Module) -> bool:
    """Whether ``model``'s decoder caches per-position K/V over full attention (see the module docstring)."""
    config = model.config
    return config.model_type in SHARED_PREFIX_MODEL_TYPES and getattr(config, "sliding_window", None) is None


def plan_prefix_sharing(batch: PackedBatch) -> PrefixPlan | None:
    """Groups rows by identical prompt; None when sharing would not save work (no prompt repeats, or
    the two padded passes hold no fewer token slots than the plain one)."""
    B = batch.size
    if B < 2:
        return None
    completion = batch.completion_lengths.tolist()
    prompt_lengths_row = [int(n) - c for n, c in zip(batch.attention_mask.sum(1).tolist(), completion, strict=True)]
    ids = batch.input_ids.tolist()
    index: dict[tuple[int, ...], int] = {}
    row_prompt = [index.setdefault(tuple(ids[b][: prompt_lengths_row[b]]), len(index)) for b in range(B)]
    G = len(index)
    if G == B:
        return None
    P = max(prompt_lengths_row)
    T = batch.completion_ids.shape[1]
    if G * P + B * max(T - 1, 0) >= B * batch.input_ids.shape[1]:
        return None
    prompt_ids = torch.zeros(G, P, dtype=torch.long)
    lengths = torch.zeros(G, dtype=torch.long)
    for prompt, g in index.items():
        prompt_ids[g, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        lengths[g] = len(prompt)
    device = batch.input_ids.device
    return PrefixPlan(prompt_ids.to(device), lengths.to(device), torch.tensor(row_prompt, dtype=torch.long,
                                                                              device=device))


def shared_prefix_hidden(decoder: nn.Module, batch: PackedBatch, plan: PrefixPlan) -> torch.Tensor:
    """Final hidden states [B, T, H] at ``batch.target_positions``, as the plain forward gives them."""
    G, P = plan.prompt_ids.shape
    B, T = batch.completion_ids.shape
    device = batch.input_ids.device
    prompt_mask = (torch.arange(P, device=device) < plan.prompt_lengths.unsqueeze(1)).long()
    cache = DynamicCache()
    prompt_hidden = decoder(input_ids=plan.prompt_ids, attention_mask=prompt_mask, past_key_values=cache,
                            use_cache=True).last_hidden_state
    flat = [prompt_hidden.flatten(0, 1)]
    row_len = plan.prompt_lengths.index_select(0, plan.row_prompt).unsqueeze(1)  # [B, 1]
    W = T - 1  # the last completion token is never an input whose output is needed
    if W > 0:
        per_row = DynamicCache(ddp_cache_data=[(layer.keys.index_select(0, plan.row_prompt),
                                                layer.values.index_select(0, plan.row_prompt))
                                               for layer in cache.layers])
        steps = torch.arange(W, device=device)
        real = steps < (batch.completion_lengths.unsqueeze(1) - 1)
        mask = torch.cat([prompt_mask.index_select(0, plan.row_prompt), real.long()], dim=1)
        completion_hidden = decoder(input_ids=batch.completion_ids[:, :W], attention_mask=mask,
                                    position_ids=row_len + steps, past_key_values=per_row,
                                    use_cache=True).last_hidden_state
        flat.append(completion_hidden.flatten(0, 1))
    pos = batch.target_positions
    in_prompt = pos < row_len
    rows = torch.arange(B, device=device).unsqueeze(1)
    index = torch.where(in_prompt, plan.row_prompt.unsqueeze(1) * P + pos, G * P + rows * W + (pos - row_len))
    return torch.cat(flat).index_select(0, index.flatten()).view(B, T, -1)
