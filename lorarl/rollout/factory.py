"""Builds a started RolloutCore from settings: the chosen engine, the fingerprint, the tokenizer."""

from __future__ import annotations

import logging

from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.core import RolloutCore
from lorarl.rollout.engine_api import GenerationEngine
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.prompts import PromptRenderer

logger = logging.getLogger(__name__)


def make_engine(settings: RolloutSettings) -> GenerationEngine:
    if settings.engine == "vllm":
        from lorarl.rollout.vllm.engine import VllmEngine

        return VllmEngine(settings)
    from lorarl.rollout.hf_engine import HfEngine

    return HfEngine(settings)


async def start_core(settings: RolloutSettings, engine: GenerationEngine | None = None) -> RolloutCore:
    """Starts the engine (minutes for big models) and returns the core serving it."""
    if settings.model_path is None:
        raise ValueError("rollout.model_path is required")
    files = ModelFiles(settings.model_path)
    fingerprint = settings.base_fingerprint or files.fingerprint()
    engine = engine if engine is not None else make_engine(settings)
    await engine.start()
    info = engine.info
    logger.info("engine %s ready: %s, vocab %d, max_model_len %d, LoRA %s%s", info.engine, info.architecture,
                info.vocab_size, info.max_model_len, info.supports_lora,
                f" ({info.lora_reason})" if info.lora_reason else "")
    return RolloutCore(engine, settings, files, fingerprint, PromptRenderer(files.root))
