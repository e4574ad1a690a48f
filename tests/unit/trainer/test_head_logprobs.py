"""The frozen-head closed form (lorarl.trainer.engines.head_logprobs) computes what autograd computes through
the plain log-softmax — the same logprobs, entropies and input gradients, to rounding —
while keeping no [tokens, vocab] tensor for backward, and steps aside for heads that train."""

from __future__ import annotations

import pytest
import torch

from lorarl.trainer.engines.head_logprobs import FrozenHeadLogprobs, head_token_logprobs, is_frozen_linear_head
from lorarl.trainer.engines.policy_engine import token_logprobs
from lorarl.trainer.rl.lora import LoRALinear

VOCAB, HIDDEN = 300, 24


def frozen_head(bias: bool = False, dtype: torch.dtype = torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=bias, dtype=dtype).requires_grad_(False)


def inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 7, HIDDEN, generator=g).to(dtype).requires_grad_(True)
    return hidden, torch.randint(0, VOCAB, (3, 7), generator=g)


def forward_backward(fn, hidden: torch.Tensor, entropy_grad: bool) -> tuple[torch.Tensor, ...]:
    hidden.grad = None
    logp, entropy = fn()
    # Uneven upstream gradients, so a wrong per-row scaling would show.
    weights = torch.linspace(0.5, 2.0, logp.numel()).view_as(logp)
    loss = (logp.float() * weights).sum() + ((0.3 * entropy.float() * weights).sum() if entropy_grad else 0.0)
    loss.backward()
    return logp.detach(), entropy.detach(), hidden.grad.clone()


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk", [0, 1, 5, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_closed_form_equals_autograd_through_the_plain_log_softmax(entropy_grad: bool, chunk: int, bias: bool) -> None:
    head = frozen_head(bias)
    hidden, targets = inputs()
    want = forward_backward(lambda: token_logprobs(head(hidden), targets, entropy_grad), hidden, entropy_grad)
    got = forward_backward(lambda: head_token_logprobs(hidden, head, targets, entropy_grad, token_logprobs, chunk),
                           hidden, entropy_grad)
    # Same per-row operations; a chunk's matmul may round differently from the whole one's.
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert want[2].norm() > 0
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-7)


def test_entropy_gradient_flows_only_when_asked() -> None:
    head = frozen_head()
    hidden, targets = inputs()
    with_grad = forward_backward(lambda: head_token_logprobs(hidden, head, targets, True, token_logprobs, 4),
                                 hidden, True)
    logp_only = forward_backward(lambda: head_token_logprobs(hidden, head, targets, False, token_logprobs, 4),
                                 hidden, False)
    assert not torch.allclose(with_grad[2], logp_only[2])
    _, entropy = head_token_logprobs(hidden, head, targets, False, token_logprobs, 4)
    assert not entropy.requires_grad


def test_bfloat16_head_agrees_with_the_plain_path_to_bf16_rounding() -> None:
    head = frozen_head(dtype=torch.bfloat16)
    hidden, targets = inputs(torch.bfloat16)
    want = forward_backward(lambda: token_logprobs(head(hidden), targets, True), hidden, True)
    got = forward_backward(lambda: head_token_logprobs(hidden, head, targets, True, token_logprobs, 5), hidden, True)
    assert got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2e-2, atol=2e-3)


def test_nothing_vocab_wide_is_kept_for_backward() -> None:
    head = frozen_head()
    hidden, targets = inputs()
    rows = targets.numel()
    saved: list[int] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        FrozenHeadLogprobs.apply(hidden.reshape(rows, -1), head.weight, None, targets.reshape(rows), True, 0)
    assert saved and max(saved) <= rows * HIDDEN  # the [rows, hidden] bases, never [rows, vocab]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        token_logprobs(head(hidden), targets, True)
    assert max(saved) >= rows * VOCAB  # the plain path keeps its log-softmax: the test can tell them apart


def test_heads_that_train_or_carry_lora_take_the_autograd_path() -> None:
    trained = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    assert is_frozen_linear_head(frozen_head()) and not is_frozen_linear_head(trained)
    hidden, targets = inputs()
    logp, _ = head_token_logprobs(hidden, trained, targets, False, token_logprobs, 4)
    logp.sum().backward()
    assert trained.weight.grad is not None and trained.weight.grad.norm() > 0

    adapted = LoRALinear(frozen_head(), rank=2, scale=2.0, dropout=0.0, generator=torch.Generator().manual_seed(0))
    assert not is_frozen_linear_head(adapted)
