"""Shared check of the export tests: vLLM's logprobs for the tokens it generated equal the engine's.

(vLLM's prompt_logprobs crash with LoRA on CPU, so generated tokens are what can be compared.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.trainer.engine_api import TrainEngine, TrajectoryRecord


def assert_engine_logprobs(engine: TrainEngine, prompts: Sequence[list[int]], outputs: Sequence[Any],
                           reference: bool, tolerance: float = 1e-4) -> list[list[int]]:
    """Asserts each vLLM output's logprobs are the engine's (policy, or reference with adapters off)
    within ``tolerance``; returns the generated token ids."""
    completions = []
    for prompt, out in zip(prompts, outputs, strict=True):
        sample = out.outputs[0]
        got = [entry[tok].logprob for entry, tok in zip(sample.logprobs, sample.token_ids, strict=True)]
        rec = TrajectoryRecord(list(prompt), list(sample.token_ids), got, [0] * len(got), 0.0)
        want = engine.compute_logprobs([rec], reference=reference)[0]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= tolerance
        completions.append(list(sample.token_ids))
    return completions
