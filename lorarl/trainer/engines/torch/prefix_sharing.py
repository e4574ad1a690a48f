"""Shared-prompt forward: each distinct prompt of a micro-batch runs through the decoder once.

A GRPO group is n completions of one prompt, so the plain forward (every row's prompt+completion)
computes each prompt n times; on the demo that is 79% of a train step's tokens. Here the distinct
prompts run once, batched and right-padded, with grad and a KV cache; the rows' completion inputs
(c0 .. cC-2: the last token is never an input whose output is needed) then run in one completion
pass at their real positions P, P+1, ... (RoPE), attending to their prompt's cached keys/values
(repeated per line by index_select, so gradients of every row flow back into the one prompt pass):

    prompt pass      [G, Pmax]     p0 .. pP-1 pad                  -> hidden, KV cache
    completion pass  [N, width]    one of two layouts (below)      keys: a prompt's cache ++ the line

Padded rows (line b = row b, width T-1, a 2D key mask: 1 on the prompt's real tokens and the real
completion inputs). Demo completions stop early at EOS, so ~45% of these slots are padding.

    row b   c0 c1 c2 pad pad pad pad

Packed lines (rows of one group laid end to end, each token at its row's true position, a 4D mask
[N, 1, width, Pmax+width]: a token sees its group's real prompt keys and its own row's earlier
completion inputs; a padding slot sees the prompt and padding, so no softmax row is empty):

    line n  c0 c1 c2 | c0 c1 c2 c3 | c0 pad        (rows a, b, c of one group; keys: that group's prompt)

Layout rule (``plan_prefix_sharing``, once per micro-batch: a Python loop over rows, then index
tensors built on the batch's device). Each group's rows (widest first) go first-fit into lines of
``capacity`` slots, for capacity T-1, 2(T-1), 4(T-1), ... up to the largest group's total; lines pad
to the fullest one. A layout costs its token slots + ``attention_cost`` x its attention elements
(slots x (Pmax + width); ``attention_cost`` is one query-key pair's work over one slot's linear
layers, from the model config: ~1e-3 on the demo model). The cheapest packing is used if it costs at
most ``PACKING_MARGIN`` x the padded rows and its mask (lines x width x (Pmax + width) elements, also
the size of its attention scores per head) is no larger than ``MAX_MASK_ELEMENTS`` or the padded
rows' own mask (B x (T-1) x (Pmax + T-1), which transformers builds from the 2D key mask), whichever
is larger; otherwise the rows stay padded. So packing never needs more mask or score memory than
the fallback beyond that fixed allowance (lines of T-1 always fit; wide lines on big batches don't),
and lines never mix groups, so attention never pays for another group's prompt keys (one line over
all groups would multiply attention work by G). On the demo batch: ~470 slots for ~400 real inputs
instead of 896 padded ones. Packing needs an attention implementation that takes an explicit 4D mask
as given (transformers' ``create_causal_mask`` returns a 4D mask unchanged): sdpa takes it boolean
(True = attend), eager additive (0 / dtype min, as transformers' ``eager_mask`` builds it); others
(flash, flex) keep the padded rows.

The hidden state predicting each completion token is taken where the plain path takes it
(``target_positions``): in the prompt pass for the first token, in the completion pass for the rest.
Exact up to float rounding, in both layouts (dense and MoE: routing is per token). Only for decoders
whose cache is per-position K/V over full attention (Qwen3, Qwen3-MoE without a sliding window):
sliding windows index cache slots rather than positions, and linear-attention layers (Qwen3.5) cache
a recurrent state. With LoRA dropout on, a group's prompt tokens share one dropout draw instead of
one per completion (same expectation; not bitwise the plain path's draws); completion tokens draw
their own, as in the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from lorarl.trainer.engines.torch import routing_replay
from lorarl.trainer.rl.batching import PackedBatch

#: Model types whose decoder this module was checked against (full attention, per-position K/V cache).
SHARED_PREFIX_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})
#: Attention implementations that take an explicit 4D mask as given (see the module docstring).
MASKABLE_ATTENTION = frozenset({"sdpa", "eager"})
#: Hard cap on a packed completion pass's mask (lines x width x (Pmax + width)) when it exceeds the padded
#: rows' own mask; above both, rows stay padded (16M elements: 16 MiB as sdpa's boolean mask).
MAX_MASK_ELEMENTS = 1 << 24
#: Packing must cost at most this fraction of the padded rows (its mask build, and the estimate's error).
PACKING_MARGIN = 0.9


@dataclass(frozen=True)
class CompletionLayout:
    """Where the completion pass puts each row's completion inputs: ``lines`` x ``width`` slots."""

    line_prompt: torch.Tensor  # [N] long, the prompt (index into G) whose cache line n attends to
    row_start: torch.Tensor  # [B] long, flat slot (line * width + offset) of row b's first input c0
    width: int
    packed: bool  # False: line b is row b right-padded to T-1 (2D key mask); True: packed lines (4D mask)

    @property
    def lines(self) -> int:
        return self.line_prompt.shape[0]

    @property
    def slots(self) -> int:
        """Decoder token slots of the completion pass, padding included."""
        return self.lines * self.width


@dataclass(frozen=True)
class PrefixPlan:
    """Which distinct prompt each row of a PackedBatch continues, and the completion pass's layout."""

    prompt_ids: torch.Tensor  # [G, Pmax] long, right-padded distinct prompts, in order of first appearance
    prompt_lengths: torch.Tensor  # [G] long
    row_prompt: torch.Tensor  # [B] long, index into G
    completions: CompletionLayout

    @property
    def prompts(self) -> int:
        return self.prompt_ids.shape[0]


def supports_prefix_sharing(model: nn.Module) -> bool:
    """Whether ``model``'s decoder caches per-position K/V over full attention (see the module docstring)."""
    config = model.config
    return config.model_type in SHARED_PREFIX_MODEL_TYPES and getattr(config, "sliding_window", None) is None


def attention_cost(model: nn.Module) -> float | None:
    """One query-key pair's attention work over one token slot's linear layers (the layout estimate's
    weight); None when the model's attention cannot take a packed layout's explicit 4D mask."""
    config = model.config
    if getattr(config, "_attn_implementation", None) not in MASKABLE_ATTENTION:
        return None
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    projections = 2 * hidden * head_dim * (heads + config.num_key_value_heads)  # q, o and k, v
    experts = getattr(config, "num_experts", 0) or 0
    if experts and getattr(config, "moe_intermediate_size", None):
        mlp = 3 * hidden * config.moe_intermediate_size * config.num_experts_per_tok + hidden * experts
    else:
        mlp = 3 * hidden * config.intermediate_size
    return 2 * heads * head_dim / (projections + mlp)  # QK^T and PV per pair, all heads


def _first_fit(widths: list[int], row_prompt: list[int], groups: int, capacity: int
               ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Each group's rows, widest first, into the first of its lines with room (``capacity`` slots):
    (prompt of each line, fill of each line, (line, offset) of each row; rows of width 0 get none)."""
    by_group: list[list[int]] = [[] for _ in range(groups)]
    for b in sorted(range(len(widths)), key=lambda b: -widths[b]):
        if widths[b] > 0:
            by_group[row_prompt[b]].append(b)
    line_prompt: list[int] = []
    fill: list[int] = []
    place = [(0, 0)] * len(widths)
    for g, rows in enumerate(by_group):
        first = len(fill)
        for b in rows:
            line = next((n for n in range(first, len(fill)) if fill[n] + widths[b] <= capacity), len(fill))
            if line == len(fill):
                fill.append(0)
                line_prompt.append(g)
            place[b] = (line, fill[line])
            fill[line] += widths[b]
    return line_prompt, fill, place


def _choose_layout(widths: list[int], row_prompt: list[int], groups: int, prompt_len: int,
                   attention_weight: float | None, device: torch.device) -> CompletionLayout:
    """The module docstring's rule: the cheapest packing under the mask cap, if it beats padded rows."""
    B, W = len(widths), max(widths, default=0)
    padded = CompletionLayout(torch.tensor(row_prompt, dtype=torch.long, device=device),
                              torch.arange(B, device=device) * W, W, packed=False)
    if attention_weight is None or W == 0:
        return padded

    def cost(slots: int, width: int) -> float:
        return slots + attention_weight * slots * (prompt_len + width)

    max_mask = max(MAX_MASK_ELEMENTS, B * W * (prompt_len + W))

    totals = [0] * groups
    for w, g in zip(widths, row_prompt, strict=True):
        totals[g] += w
    capacities = [W]
    while capacities[-1] < max(totals):
        capacities.append(min(2 * capacities[-1], max(totals)))
    best: tuple[float, list[int], int, list[tuple[int, int]]] | None = None
    for capacity in capacities:
        line_prompt, fill, place = _first_fit(widths, row_prompt, groups, capacity)
        width = max(fill)
        slots = len(fill) * width
        if slots * (prompt_len + width) > max_mask:
            continue
        if best is None or cost(slots, width) < best[0]:
            best = (cost(slots, width), line_prompt, width, place)
    if best is None or best[0] > PACKING_MARGIN * cost(B * W, W):
        return padded
    _, line_prompt, width, place = best
    starts = [line * width + offset for line, offset in place]
    return CompletionLayout(torch.tensor(line_prompt, dtype=torch.long, device=device),
                            torch.tensor(starts, dtype=torch.long, device=device), width, packed=True)


def plan_prefix_sharing(batch: PackedBatch, attention_weight: float | None = None) -> PrefixPlan | None:
    """Groups rows by identical prompt; None when sharing would not save work (no prompt repeats, or
    the two padded passes hold no fewer token slots than the plain one). ``attention_weight``
    (``attention_cost`` of the model) lets the completion pass pack its rows; None keeps them padded."""
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
    widths = [max(c - 1, 0) for c in completion]  # completion inputs per row: all but the last token
    layout = _choose_layout(widths, row_prompt, G, P, attention_weight, device)
    return PrefixPlan(prompt_ids.to(device), lengths.to(device),
                      torch.tensor(row_prompt, dtype=torch.long, device=device), layout)


def packed_completion_inputs(batch: PackedBatch, plan: PrefixPlan, row_len: torch.Tensor, prompt_mask: torch.Tensor,
                             mask_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids [N, width], 4D mask [N, 1, width, Pmax+width]) of packed lines, built with
    index tensors on the batch's device; ``mask_dtype`` None: boolean (sdpa), else additive (eager)."""
    layout = plan.completions
    N, width = layout.lines, layout.width
    B = batch.size
    device = batch.input_ids.device
    W = batch.completion_ids.shape[1] - 1
    steps = torch.arange(W, device=device)
    real = steps < (batch.completion_lengths.unsqueeze(1) - 1)  # [B, W] real completion inputs
    slots = (layout.row_start.unsqueeze(1) + steps)[real]
    ids = torch.zeros(N * width, dtype=torch.long, device=device)
    ids[slots] = batch.completion_ids[:, :W][real]
    positions = torch.zeros(N * width, dtype=torch.long, device=device)
    positions[slots] = (row_len + steps)[real]
    row = torch.full((N * width,), -1, dtype=torch.long, device=device)  # -1: padding slot
    row[slots] = torch.arange(B, device=device).unsqueeze(1).expand_as(real)[real]
    row = row.view(N, width)
    P = prompt_mask.shape[1]
    # Filled in place: the mask is the one big tensor here (lines x width x (Pmax + width)), so no temporaries.
    mask = torch.empty(N, width, P + width, dtype=torch.bool, device=device)
    mask[:, :, :P] = prompt_mask.bool().index_select(0, layout.line_prompt).unsqueeze(1)  # the line's prompt
    own = mask[:, :, P:]
    torch.eq(row.unsqueeze(2), row.unsqueeze(1), out=own)  # own row's inputs (padding: other padding)
    own &= torch.ones(width, width, dtype=torch.bool, device=device).tril()  # earlier ones only
    mask = mask.unsqueeze(1)
    if mask_dtype is not None:
        mask = torch.where(mask, torch.tensor(0.0, dtype=mask_dtype, device=device), torch.finfo(mask_dtype).min)
    return ids.view(N, width), positions.view(N, width), mask


def shared_prefix_hidden(decoder: nn.Module, batch: PackedBatch, plan: PrefixPlan) -> torch.Tensor:
    """Final hidden states [B, T, H] at ``batch.target_positions``, as the plain forward gives them."""
    G, P = plan.prompt_ids.shape
    B, T = batch.completion_ids.shape
    layout = plan.completions
    device = batch.input_ids.device
    prompt_mask = (torch.arange(P, device=device) < plan.prompt_lengths.unsqueeze(1)).long()
    cache = DynamicCache()
    # Recorded experts (R3), when the batch carries them, laid out like each pass's tokens.
    replay = routing_replay.prompt_pass_replay(batch, plan.row_prompt, plan.prompt_lengths, P)
    prompt_hidden = decoder(input_ids=plan.prompt_ids, attention_mask=prompt_mask, past_key_values=cache,
                            use_cache=True, **({} if replay is None else {"routing_replay": replay})
                            ).last_hidden_state
    flat = [prompt_hidden.flatten(0, 1)]
    row_len = plan.prompt_lengths.index_select(0, plan.row_prompt).unsqueeze(1)  # [B, 1]
    if layout.slots > 0:
        # Each layer's cache is on that layer's device (lorarl.trainer.engines.torch.layer_split).
        per_line = DynamicCache(ddp_cache_data=[(layer.keys.index_select(0, layout.line_prompt.to(layer.keys.device)),
                                                 layer.values.index_select(0, layout.line_prompt.to(layer.keys.device)))
                                                for layer in cache.layers])
        if layout.packed:
            eager = decoder.config._attn_implementation == "eager"
            ids, positions, mask = packed_completion_inputs(batch, plan, row_len, prompt_mask,
                                                            prompt_hidden.dtype if eager else None)
        else:
            steps = torch.arange(layout.width, device=device)
            real = steps < (batch.completion_lengths.unsqueeze(1) - 1)
            mask = torch.cat([prompt_mask.index_select(0, plan.row_prompt), real.long()], dim=1)
            ids, positions = batch.completion_ids[:, : layout.width], row_len + steps
        replay = routing_replay.completion_pass_replay(batch, layout.row_start, layout.slots, row_len)
        completion_hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions,
                                    past_key_values=per_line, use_cache=True,
                                    **({} if replay is None else {"routing_replay": replay})).last_hidden_state
        flat.append(completion_hidden.flatten(0, 1))
    pos = batch.target_positions
    in_prompt = pos < row_len
    index = torch.where(in_prompt, plan.row_prompt.unsqueeze(1) * P + pos,
                        G * P + layout.row_start.unsqueeze(1) + (pos - row_len))
    return torch.cat(flat).index_select(0, index.flatten()).view(B, T, -1)
