"""The documented fallback for adapters: PEFT directories on a tmpfs and vLLM's public add_lora only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.factory import start_core
from lorarl.rollout.payloads import PolicyPayload
from lorarl.rollout.schema import GenerateInput, Mode, PolicyRef, Sampling
from tests.integration.rollout.harness import reference_greedy
from tests.unit.rollout.models import LORA, PROMPT, dense_model_dir, random_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_adapters_through_a_tmpfs_directory(tmp_path: Path) -> None:
    model_dir = dense_model_dir()
    adapter = random_adapter(model_dir, seed=31)
    settings = RolloutSettings(model_path=str(model_dir), dtype="float32", max_model_len=256, kv_cache_gib=0.25,
                               adapter_source="shm", shm_dir=str(tmp_path))

    async def main() -> tuple[list[int], list[Path]]:
        core = await start_core(settings)
        try:
            await core.load(PolicyPayload("shm", 1, Mode.ADAPTER, Mode.ADAPTER, core.fingerprint, adapter, LORA))
            written = sorted(tmp_path.rglob("adapter_model.safetensors"))
            sampling = Sampling(temperature=0.0, max_tokens=16, ignore_eos=True)
            [result] = await core.generate(GenerateInput("r", (PROMPT,), sampling, PolicyRef("shm")))
            await core.unload("shm")
            return result.completions[0].token_ids, written
        finally:
            await core.close()

    tokens, written = asyncio.run(main())
    assert len(written) == 1 and written[0].parent.name.startswith("shm-v1.")  # AdapterHandle.key
    assert tokens == reference_greedy(model_dir, PROMPT, 16, adapter, LORA)[0]
    assert not list(tmp_path.rglob("*.safetensors"))  # unloaded and closed: nothing left on the tmpfs
