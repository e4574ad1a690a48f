"""The trainer's PEFT export served by vLLM (LoRARequest) gives the trainer's own logprobs (fp32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lorarl.assets import DENSE_MODEL_DIR
from lorarl.trainer.engines.api import TrainingSpec
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.lora import LoraConfig, lora_parameters
from tests.integration.trainer.vllm_parity import assert_engine_logprobs, vllm_greedy_with_and_without

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = [[257, 10, 55, 43, 52, 258, 10, 257, 9], [257, 40, 41, 42, 43, 44], [257, 115, 111, 114, 116, 32, 49]]


def test_vllm_lora_request_matches_trainer_logprobs(tmp_path: Path) -> None:

    engine = TorchEngine(TrainingSpec(base_model_path=str(DENSE_MODEL_DIR), lora=LoraConfig(rank=8, alpha=16)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lora_parameters(engine.model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter = engine.export_adapter(tmp_path / "adapter")
    with_lora, without = vllm_greedy_with_and_without(DENSE_MODEL_DIR, adapter, PROMPTS)

    adapted = assert_engine_logprobs(engine, PROMPTS, with_lora, reference=False)
    base = assert_engine_logprobs(engine, PROMPTS, without, reference=True)
    # The adapter really changes the policy, so the comparisons above can fail.
    assert adapted != base
