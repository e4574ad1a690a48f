"""Shared check of the export tests: vLLM's logprobs for the tokens it generated equal the engine's.

(vLLM's prompt_logprobs crash with LoRA on CPU, so generated tokens are what can be compared.)
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorarl.trainer.engines.api import TrainEngine, TrajectoryRecord


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


def vllm_greedy_with_and_without(model_dir: Path, adapter_dir: Path, prompts: Sequence[list[int]]
                                 ) -> tuple[list[Any], list[Any]]:
    """vLLM's greedy generations (8 tokens, with logprobs) of ``prompts`` with the PEFT adapter and
    without it, in an in-process engine that is gone when this returns."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=128,
              enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        params = SamplingParams(max_tokens=8, logprobs=0, temperature=0.0, ignore_eos=True)
        requests = [{"prompt_token_ids": seq} for seq in prompts]
        with_lora = llm.generate(requests, params, lora_request=LoRARequest("adapter", 1, str(adapter_dir)))
        return with_lora, llm.generate(requests, params)
    finally:
        del llm
        gc.collect()
