"""Completion logprobs through a frozen LM head, with the head's gradient formed during the forward.

At real vocabularies the LM head is most of a LoRA step: Qwen3's 151,936-token head on a 0.6B
model costs more than its 28 layers. Autograd needs the log-softmax [tokens, V] for backward, so the
chunked path (lorarl.trainer.engines.recompute) recomputes each chunk's logits there: three [tokens, V]
matmuls per step (forward, recompute, backward). With the head frozen (LoRA never adapts it) the
gradient to its input has a closed form that needs only the softmax, which the forward holds anyway:

    d logp[t] / d hidden = W[t] - p @ W              p = softmax(hidden @ W^T)
    d entropy / d hidden = -(p * (log p + entropy)) @ W

so `FrozenHeadLogprobs` takes the ``p @ W`` matmul in forward, keeps that [tokens, hidden] fp32
basis, and its backward is one multiply: two matmuls per step instead of three, and no [tokens, V]
tensor is kept between forward and backward whatever the chunk size. Measured on 2,048 tokens of
the 0.6B head (1 thread, bench/head_logprobs.py): 16.9 s against 26.5 s chunked, and 18.1 s for the
whole micro-batch at once, which keeps 1.2 GiB of log-softmax for backward.
The logprobs and entropies are those of `token_logprobs` (the same per-row operations; a chunk's
matmul may round apart from the whole one's), the gradients agree to fp32 rounding (the subtraction
happens in fp32 instead of on rounded logit gradients).
"""

from __future__ import annotations

import torch
from torch import nn

from lorarl.trainer.engines.recompute import TokenLogprobs, chunked_token_logprobs


def is_frozen_linear_head(head: nn.Module) -> bool:
    """Whether ``head`` is a plain linear layer none of whose parameters train (the closed form holds)."""
    return type(head) is nn.Linear and not any(p.requires_grad for p in head.parameters())


class FrozenHeadLogprobs(torch.autograd.Function):
    """(hidden [N, H], targets [N]) -> (logprobs [N], entropy [N]) through a frozen linear head.

    Differentiable in ``hidden`` only; entropy carries gradient only when ``entropy_grad``.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                targets: torch.Tensor, entropy_grad: bool, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        logps, entropies, logp_bases, entropy_bases = [], [], [], []
        rows = chunk_tokens if chunk_tokens > 0 else max(1, hidden.shape[0])
        for h, t in zip(hidden.split(rows), targets.split(rows), strict=True):
            logits = nn.functional.linear(h, weight, bias)
            logp_all = torch.log_softmax(logits.float(), dim=-1)
            del logits
            logps.append(logp_all.gather(-1, t.unsqueeze(-1)).squeeze(-1))
            probs = logp_all.exp()
            # Row-wise dot products, sum(p * log p), as one batched matmul: no [rows, V] temporary. Pieces
            # of p * log p (32 rows, 19 MiB) fragmented glibc's heap in the trainer until they added up to
            # a third [rows, V] tensor at the peak.
            entropy = -torch.bmm(probs.unsqueeze(1), logp_all.unsqueeze(2)).view(-1)
            entropies.append(entropy)
            logp_bases.append(weight[t].float() - (probs.to(weight.dtype) @ weight).float())
            if entropy_grad:
                logp_all.add_(entropy.unsqueeze(-1)).mul_(probs)  # p * (log p + H), in place
                entropy_bases.append(-(logp_all.to(weight.dtype) @ weight).float())
            del logp_all, probs  # before the next chunk's logits: one chunk's [rows, V] tensors at a time
        logp, entropy = torch.cat(logps), torch.cat(entropies)
        if entropy_grad:
            ctx.save_for_backward(torch.cat(logp_bases), torch.cat(entropy_bases))
        else:
            ctx.save_for_backward(torch.cat(logp_bases))
            ctx.mark_non_differentiable(entropy)
        ctx.hidden_dtype = hidden.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):  # type: ignore[override]
        bases = ctx.saved_tensors
        grad = grad_logp.float().unsqueeze(-1) * bases[0]
        if len(bases) > 1 and grad_entropy is not None:
            grad = grad + grad_entropy.float().unsqueeze(-1) * bases[1]
        return grad.to(ctx.hidden_dtype), None, None, None, None, None


def head_token_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, entropy_grad: bool,
                        token_logprobs: TokenLogprobs, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs(head(hidden), targets, entropy_grad)`` for hidden [B, T, H], targets [B, T], by the
    cheapest exact route: the closed form when gradients flow to ``hidden`` through a frozen linear head,
    else `chunked_token_logprobs` (no-grad passes, and heads that train or are not plain linear layers)."""
    grad = torch.is_grad_enabled() and hidden.requires_grad
    if not (grad and is_frozen_linear_head(head)):
        return chunked_token_logprobs(hidden, head, targets, entropy_grad, token_logprobs, chunk_tokens)
    B, T = targets.shape
    logp, entropy = FrozenHeadLogprobs.apply(hidden.reshape(B * T, -1), head.weight, head.bias,
                                             targets.reshape(B * T), entropy_grad, chunk_tokens)
    return logp.view(B, T), entropy.view(B, T)
