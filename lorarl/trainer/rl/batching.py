"""Trajectories -> right-padded tensors, and a batch -> micro-batches under a token budget.

Layout of one packed row (prompt P tokens, completion C tokens, right-padded to L):

    input_ids        p0 p1 .. pP-1 c0 c1 .. cC-1 pad pad
    target_positions  [P-1, P, .., P+C-2]        (the logit at position i predicts token i+1)

Per-token tensors are [B, T] aligned with completion tokens (T = longest completion), so they plug
straight into lorarl.trainer.rl.losses. Advantages are computed once on the whole batch (group
statistics need every member of a group) and then sliced, never recomputed per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from lorarl.trainer.rl.losses import LossSpec, group_advantages, overlong_penalty
from lorarl.trainer.rl.trajectory import TrajectoryRecord


@dataclass
class PackedBatch:
    """A micro-batch as tensors; [B, L] for the model input, [B, T] per completion token, [B] per row."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    target_positions: torch.Tensor  # [B, T] long, index into L of the logit predicting each token
    completion_ids: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, T] float, 1 on the completion tokens the loss trains (the policy's own)
    behavior_logp: torch.Tensor  # [B, T] float
    token_versions: torch.Tensor  # [B, T] long
    advantages: torch.Tensor  # [B] float
    completion_lengths: torch.Tensor  # [B] long
    token_advantages: torch.Tensor | None = None  # [B, T] float: the caller's, for the token losses
    teacher_logp: torch.Tensor | None = None  # [B, T] float: the teachers' logprobs of the tokens (distillation)
    routes: torch.Tensor | None = None  # [B, L, moe layers, k] int16: recorded experts per input position, -1: none

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                              for f in fields(self)})


def group_index(records: Sequence[TrajectoryRecord]) -> torch.Tensor:
    """Dense group numbers in order of first appearance (group_id, or the prompt when empty)."""
    ids: dict[object, int] = {}
    return torch.tensor([ids.setdefault(r.group_key(), len(ids)) for r in records], dtype=torch.long)


def shaped_rewards(records: Sequence[TrajectoryRecord], loss: LossSpec) -> torch.Tensor:
    """Rewards with DAPO's soft overlong penalty applied (before advantages, as DAPO does)."""
    rewards = torch.tensor([float(r.reward) for r in records], dtype=torch.float32)
    if loss.overlong_buffer and loss.overlong_penalty:
        lengths = torch.tensor([r.trained_tokens for r in records])  # the policy's tokens, not the tools'
        rewards = rewards + overlong_penalty(lengths, loss.max_response_tokens, loss.overlong_buffer,
                                             loss.overlong_penalty)
    return rewards


def compute_advantages(records: Sequence[TrajectoryRecord], loss: LossSpec) -> torch.Tensor:
    """Per-sequence advantages over the whole batch, by the loss family's group rule (none for the losses
    that take the caller's per-token advantages: zeros, unread)."""
    if loss.takes_token_advantages:
        return torch.zeros(len(records))
    return group_advantages(shaped_rewards(records, loss), group_index(records), loss.type)


def pack(records: Sequence[TrajectoryRecord], advantages: torch.Tensor | None = None,
         pad_token_id: int = 0) -> PackedBatch:
    """Right-pads prompt+completion rows; missing behaviour logprobs / versions become zeros."""
    if not records:
        raise ValueError("cannot pack an empty batch")
    B = len(records)
    L = max(r.num_tokens for r in records)
    T = max(len(r.completion_token_ids) for r in records)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    target_positions = torch.zeros(B, T, dtype=torch.long)
    completion_ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    behavior = torch.zeros(B, T)
    versions = torch.zeros(B, T, dtype=torch.long)
    given = any(r.token_advantages is not None for r in records)
    token_adv = torch.zeros(B, T) if given else None
    teacher = torch.zeros(B, T) if any(r.teacher_logprobs is not None for r in records) else None
    for b, r in enumerate(records):
        P, C = len(r.prompt_token_ids), len(r.completion_token_ids)
        if P < 1:
            raise ValueError(f"record {b}: the prompt needs at least one token to predict the completion from")
        input_ids[b, : P + C] = torch.tensor(list(r.prompt_token_ids) + list(r.completion_token_ids))
        attention_mask[b, : P + C] = 1
        target_positions[b, :C] = torch.arange(P - 1, P + C - 1)
        completion_ids[b, :C] = torch.tensor(r.completion_token_ids)
        trained = torch.tensor(r.trained(), dtype=torch.bool)
        mask[b, :C] = trained.float()
        # A masked (tool/environment) token's logprob and version are never read: zeros keep its ratio and
        # importance weight finite, so its zero mask also zeroes its gradient (inf * 0 would be NaN).
        if r.behavior_logprobs:
            behavior[b, :C] = torch.tensor(r.behavior_logprobs, dtype=torch.float32).where(trained, 0.0)
        if r.token_versions:
            versions[b, :C] = torch.tensor(r.token_versions, dtype=torch.long).where(trained, 0)
        if token_adv is not None and r.token_advantages is not None:
            token_adv[b, :C] = torch.tensor(r.token_advantages, dtype=torch.float32).where(trained, 0.0)
        if teacher is not None and r.teacher_logprobs is not None:
            teacher[b, :C] = torch.tensor(r.teacher_logprobs, dtype=torch.float32).where(trained, 0.0)
    adv = torch.zeros(B) if advantages is None else advantages.detach().float().reshape(B).clone()
    lengths = torch.tensor([len(r.completion_token_ids) for r in records], dtype=torch.long)
    return PackedBatch(input_ids, attention_mask, target_positions, completion_ids, mask, behavior, versions,
                       adv, lengths, token_adv, teacher, packed_routes(records, L))


def packed_routes(records: Sequence[TrajectoryRecord], length: int) -> torch.Tensor | None:
    """[B, length, layers, k] int16 of the records' routes by input position, -1 where a record has none (or
    past its routed positions); None when no record carries routes."""
    given = [r.routes for r in records if r.routes is not None]
    if not given:
        return None
    layers, k = given[0].layers, given[0].top_k
    out = torch.full((len(records), length, layers, k), -1, dtype=torch.int16)
    for b, r in enumerate(records):
        if r.routes is not None:
            n = min(r.routes.positions, length)
            out[b, :n] = torch.from_numpy(r.routes.ids[:n])
    return out


def micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive index groups whose summed lengths stay within ``budget`` (0: one group).

    Order is kept (predictable, and equal batches split equally on every data-parallel rank);
    a sequence longer than the budget gets a micro-batch of its own.
    """
    if budget <= 0:
        return [list(range(len(lengths)))] if lengths else []
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def split(records: Sequence[TrajectoryRecord], advantages: torch.Tensor, budget: int
          ) -> list[tuple[list[int], PackedBatch]]:
    """Packs each micro-batch with its slice of the whole-batch advantages."""
    out = []
    for idx in micro_batches([r.num_tokens for r in records], budget):
        out.append((idx, pack([records[i] for i in idx], advantages[idx])))
    return out
