"""Trading compute for memory in the torch engine: decoder layers recomputed in backward, and the LM
head's log-softmax taken a chunk of tokens at a time.

Activation checkpointing. A transformers decoder layer with LoRA saves ~189 KiB per token for
backward at the Qwen3-8B shape; checkpointed, it keeps only its input (hidden size x dtype bytes)
and recomputes the rest when the backward pass reaches it (one layer's activations alive at a time).
transformers' own ``gradient_checkpointing_enable`` drops the KV cache, which the shared-prompt
forward (lorarl.trainer.engines.torch.prefix_sharing) needs: its completion pass attends to the prompt pass's
keys and values. `enable_activation_checkpointing` therefore wraps each layer itself
(``torch.utils.checkpoint``, non-reentrant) and hands the recomputation a cache that replays what the
layer saw the first time — the keys and values before the layer's own update — without writing the
real cache a second time. Gradients flow through the original graph; the replay only rebuilds the
tensors the backward needs, from the same inputs and the same RNG state (LoRA dropout draws repeat).

Chunked log-probabilities. For a micro-batch of N completion tokens the plain path builds [N, V]
logits, an fp32 copy and an fp32 log-softmax (V = 151,936 for Qwen3: ~1.8 MiB per token), all kept
for backward. `chunked_token_logprobs` runs the LM head and log-softmax on ``chunk_tokens`` rows at
a time, each chunk checkpointed, so at most one chunk's [tokens, V] tensors are alive, in forward or
backward; the values are those of the plain path (per-row operations).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# The default rows of one logits chunk (1024 x 151,936 fp32 is 0.6 GiB per [tokens, vocab] tensor) is the
# training spec's (memory.logits_chunk_tokens).
from lorarl.contract.training import DEFAULT_LOGITS_CHUNK_TOKENS

_ORIGINAL_FORWARD = "_lorarl_forward_without_checkpointing"

TokenLogprobs = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


class _ReplayCache:
    """The KV cache one layer's recomputation sees: ``update`` returns the keys/values before the layer's
    first update with the new ones appended (what the real cache returned then) and stores nothing."""

    def __init__(self, before: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._before = before

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self._before is None:
            return keys, values
        old_keys, old_values = self._before
        return torch.cat([old_keys, keys], dim=-2), torch.cat([old_values, values], dim=-2)


def _layer_state(cache: Any, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache's keys/values for ``layer_idx`` before the layer writes (None: nothing cached yet)."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    keys = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", keys is not None) or keys is None or keys.numel() == 0:
        return None
    return layer.keys, layer.values


def _checkpointed_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    forward = getattr(self, _ORIGINAL_FORWARD)
    if not torch.is_grad_enabled():
        return forward(hidden_states, *args, **kwargs)
    cache = kwargs.pop("past_key_values", None)
    layer_idx = getattr(getattr(self, "self_attn", None), "layer_idx", None)
    if cache is not None and layer_idx is None:
        raise TypeError(f"{type(self).__name__} has no self_attn.layer_idx: cannot replay its KV cache")
    before = _layer_state(cache, layer_idx) if cache is not None else None
    first = [True]

    def run(hidden: torch.Tensor) -> Any:
        if cache is None:
            return forward(hidden, *args, **kwargs)
        if first[0]:
            first[0] = False
            return forward(hidden, *args, past_key_values=cache, **kwargs)
        return forward(hidden, *args, past_key_values=_ReplayCache(before), **kwargs)

    return checkpoint(run, hidden_states, use_reentrant=False)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM, or of a megatron GPTModel (``decoder.layers``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "decoder", model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(decoder).__name__} has no decoder layers to checkpoint")
    return layers


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Every decoder layer of ``model`` recomputes its activations in backward; returns how many.

    Parameter names and the module tree are unchanged (the layers' ``forward`` is wrapped in place),
    so checkpoints, exports and LoRA naming are unaffected; no-grad passes run as before.
    """
    layers = decoder_layers(model)
    for layer in layers:
        if not hasattr(layer, _ORIGINAL_FORWARD):
            setattr(layer, _ORIGINAL_FORWARD, layer.forward)
            layer.forward = types.MethodType(_checkpointed_forward, layer)
    return len(layers)


def disable_activation_checkpointing(model: nn.Module) -> None:
    for layer in decoder_layers(model):
        if hasattr(layer, _ORIGINAL_FORWARD):
            # the forward it wrapped: the class's, or another wrapper beneath (routing replay's)
            layer.forward = getattr(layer, _ORIGINAL_FORWARD)
            delattr(layer, _ORIGINAL_FORWARD)


def activation_checkpointing_enabled(model: nn.Module) -> bool:
    return any(hasattr(layer, _ORIGINAL_FORWARD) for layer in decoder_layers(model))


def chunked_token_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, entropy_grad: bool,
                           token_logprobs: TokenLogprobs, chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs(head(hidden), targets, entropy_grad)`` computed ``chunk_tokens`` rows at a time.

    hidden [B, T, H], targets [B, T] -> (logprobs [B, T], entropy [B, T]). With one chunk or fewer it is
    the plain call; otherwise each chunk is checkpointed when gradients are on, so backward recomputes
    its logits instead of keeping them (one extra LM-head matmul per chunk).
    """
    B, T = targets.shape
    if chunk_tokens <= 0 or chunk_tokens >= B * T:
        return token_logprobs(head(hidden), targets, entropy_grad)
    flat_hidden, flat_targets = hidden.reshape(B * T, -1), targets.reshape(B * T)

    def one_chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = token_logprobs(head(h).unsqueeze(0), t.unsqueeze(0), entropy_grad)
        return logp.squeeze(0), entropy.squeeze(0)

    grad = torch.is_grad_enabled() and (flat_hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    pieces = []
    for h, t in zip(flat_hidden.split(chunk_tokens), flat_targets.split(chunk_tokens), strict=True):
        pieces.append(checkpoint(one_chunk, h, t, use_reentrant=False) if grad else one_chunk(h, t))
    logp = torch.cat([p[0] for p in pieces]).view(B, T)
    entropy = torch.cat([p[1] for p in pieces]).view(B, T)
    return logp, entropy
