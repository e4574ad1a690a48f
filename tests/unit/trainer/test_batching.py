"""Packing trajectories into tensors and splitting batches under a token budget."""

from __future__ import annotations

import pytest
import torch

from lorarl.trainer.engines.api import TrajectoryRecord
from lorarl.trainer.rl.batching import (
    compute_advantages,
    group_index,
    micro_batches,
    pack,
    shaped_rewards,
    split,
)
from lorarl.trainer.rl.losses import LossSpec, group_advantages


def rec(prompt: list[int], completion: list[int], reward: float = 0.0, group: str = "", version: int = 0
        ) -> TrajectoryRecord:
    return TrajectoryRecord(prompt, completion, [-0.5 - 0.1 * i for i in range(len(completion))],
                            [version] * len(completion), reward, group)


def test_pack_aligns_completion_tokens_with_the_logits_that_predict_them() -> None:
    records = [rec([1, 2, 3], [4, 5]), rec([7], [8, 9, 10, 11], version=3)]
    b = pack(records, torch.tensor([0.5, -0.5]), pad_token_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # Row 0: completion tokens 4, 5 sit at positions 3, 4 and are predicted by logits at 2, 3.
    assert b.target_positions[0, :2].tolist() == [2, 3]
    assert b.target_positions[1].tolist() == [0, 1, 2, 3]
    for row in range(2):
        n = int(b.mask[row].sum())
        predicted = b.input_ids[row, b.target_positions[row, :n] + 1]
        assert predicted.tolist() == b.completion_ids[row, :n].tolist()
    assert b.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert b.behavior_logp[0].tolist() == pytest.approx([-0.5, -0.6, 0, 0])
    assert b.token_versions.tolist() == [[0, 0, 0, 0], [3, 3, 3, 3]]
    assert b.advantages.tolist() == [0.5, -0.5]
    assert b.completion_lengths.tolist() == [2, 4]


def test_pack_right_pads_shorter_rows() -> None:
    b = pack([rec([1, 2], [3]), rec([1, 2, 3, 4], [5, 6])], pad_token_id=96)
    assert b.input_ids.tolist() == [[1, 2, 3, 96, 96, 96], [1, 2, 3, 4, 5, 6]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]


def test_pack_refuses_empty_prompt_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="prompt"):
        pack([rec([], [1, 2])])
    with pytest.raises(ValueError, match="empty"):
        pack([])


def test_micro_batches_respect_the_budget_and_isolate_long_sequences() -> None:
    assert micro_batches([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    assert micro_batches([3, 3, 3, 3], 7) == [[0, 1], [2, 3]]
    assert micro_batches([2, 10, 2, 2], 5) == [[0], [1], [2, 3]]
    assert micro_batches([4, 4], 0) == [[0, 1]]
    assert micro_batches([], 8) == []
    for budget in (1, 5, 9, 13):
        lengths = [3, 7, 1, 4, 4, 2, 9]
        groups = micro_batches(lengths, budget)
        assert [i for g in groups for i in g] == list(range(len(lengths)))
        for g in groups:
            assert len(g) == 1 or sum(lengths[i] for i in g) <= budget


def test_advantages_use_the_whole_group_even_when_split_across_micro_batches() -> None:
    records = [rec([1], [2, 3], 1.0, "a"), rec([1], [4, 5], 0.0, "a"), rec([6], [7, 8], 0.0, "b"),
               rec([6], [9, 9], 0.0, "b"), rec([6], [3, 3], 3.0, "b")]
    adv = compute_advantages(records, LossSpec(type="grpo"))
    expected = group_advantages(torch.tensor([1.0, 0, 0, 0, 3]), torch.tensor([0, 0, 1, 1, 1]), "grpo")
    torch.testing.assert_close(adv, expected)
    parts = split(records, adv, budget=3)  # one sequence per micro-batch
    assert len(parts) == 5
    got = torch.cat([p.advantages for _, p in parts])
    torch.testing.assert_close(got, adv)
    assert adv[0] > 0 > adv[1]  # computed within group "a" although 0 and 1 land in different micro-batches


def test_empty_group_id_groups_by_prompt() -> None:
    records = [rec([1, 2], [3]), rec([5], [3]), rec([1, 2], [4]), rec([5], [6], group="x")]
    assert group_index(records).tolist() == [0, 1, 0, 2]


def test_overlong_penalty_shapes_rewards_before_advantages() -> None:
    settings = LossSpec(type="dapo", overlong_buffer=2, overlong_penalty=1.0, max_response_tokens=4)
    records = [rec([1], [2, 2], 1.0, "g"), rec([1], [2, 2, 2], 1.0, "g"), rec([1], [2, 2, 2, 2], 1.0, "g")]
    assert shaped_rewards(records, settings).tolist() == pytest.approx([1.0, 0.5, 0.0])
    adv = compute_advantages(records, settings)
    assert adv[0] > adv[1] > adv[2]
    # Without the penalty every reward is equal, so there is nothing to learn.
    assert compute_advantages(records, LossSpec(type="dapo")).abs().max() == 0
