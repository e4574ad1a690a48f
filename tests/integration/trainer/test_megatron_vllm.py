"""The Megatron engine's PEFT export served by vLLM (LoRARequest) gives the engine's own logprobs (fp32).

Dense only: vLLM's CPU backend cannot apply LoRA to MoE experts (the MoE export is checked against
transformers + PEFT and the merged model in tests/unit/trainer/megatron/test_export.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lorarl.assets import DENSE_MODEL_DIR
from lorarl.trainer.engines.api import TrainingSpec
from lorarl.trainer.engines.megatron.engine import MegatronEngine
from lorarl.trainer.rl.lora import LoraConfig
from tests.integration.trainer.vllm_parity import assert_engine_logprobs, vllm_greedy_with_and_without

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = [[257, 10, 55, 43, 52, 258, 10, 257, 9], [257, 40, 41, 42, 43, 44], [257, 115, 111, 114, 116, 32, 49]]


def test_vllm_serves_the_megatron_adapter_with_the_engines_logprobs(tmp_path: Path) -> None:

    from lorarl.trainer.engines.megatron.parallel import teardown

    spec = TrainingSpec(base_model_path=str(DENSE_MODEL_DIR), engine="megatron", lora=LoraConfig(rank=8, alpha=16))
    engine = MegatronEngine(spec)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in engine.named_trainable_parameters().values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter = engine.export_adapter(tmp_path / "adapter")
    engine.save_checkpoint(tmp_path / "ckpt")
    teardown()  # vLLM sets up (and tears down) torch.distributed in this process for itself
    with_lora, without = vllm_greedy_with_and_without(DENSE_MODEL_DIR, adapter, PROMPTS)
    teardown()
    engine = MegatronEngine(spec)
    engine.load_checkpoint(tmp_path / "ckpt")

    adapted = assert_engine_logprobs(engine, PROMPTS, with_lora, reference=False)
    base = assert_engine_logprobs(engine, PROMPTS, without, reference=True)
    assert adapted != base  # the adapter really changes the policy, so the comparisons above can fail
