"""A deterministic GenerationEngine for core tests: arithmetic "model", real pauses, aborts and switches.

The next token is a function of the context and of what the engine serves (base weights, an
adapter, or a merged label), so tests can tell exactly which policy produced each token. One step
per segment every `step_s` seconds; `pause()` freezes all segments, `abort()` ends them with ABORT.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence

import torch

from lorarl.contract.lora import LoraSpec
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.schema import (
    AdapterHandle,
    EngineInfo,
    EngineStats,
    Finish,
    SegmentEvent,
    SegmentSpec,
)

VOCAB = 264


def next_token(context: Sequence[int], salt: str) -> int:
    """The fake model: deterministic in (context, what is served)."""
    return zlib.crc32(f"{salt}|{sum(context)}|{len(context)}".encode()) % 250


class FakeEngine:
    def __init__(self, files: ModelFiles, *, supports_lora: bool = True, max_lora_rank: int = 16, max_loras: int = 4,
                 step_s: float = 0.002) -> None:
        self.files = files
        self.info = EngineInfo(engine="fake", model_path=str(files.root), architecture=files.architecture,
                               vocab_size=VOCAB, max_model_len=512, eos_token_ids=(258,), is_moe=files.is_moe,
                               supports_lora=supports_lora, lora_reason="" if supports_lora else "fake: no LoRA",
                               max_lora_rank=max_lora_rank if supports_lora else 0,
                               max_loras=max_loras if supports_lora else 0)
        self.step_s = step_s
        self.label = "base"
        self.adapters: dict[int, AdapterHandle] = {}
        self.staged: dict[str, dict[str, torch.Tensor]] = {}
        self.running = asyncio.Event()
        self.running.set()
        self.aborted: set[str] = set()
        self.live: set[str] = set()
        self.peak = 0
        self.fail_add_adapter: Exception | None = None
        self.calls: list[str] = []

    def salt(self, adapter: AdapterHandle | None) -> str:
        return f"{self.label}+{adapter.name}" if adapter is not None else self.label

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def wait_dead(self) -> str:
        await asyncio.Event().wait()
        return ""

    async def submit(self, spec: SegmentSpec) -> AsyncIterator[SegmentEvent]:
        if spec.adapter is not None and spec.adapter.lora_int_id not in self.adapters:
            raise RuntimeError(f"{spec.adapter.name} not loaded")
        self.live.add(spec.request_id)
        self.peak = max(self.peak, len(self.live))
        return self._run(spec)

    async def _run(self, spec: SegmentSpec) -> AsyncIterator[SegmentEvent]:
        context = list(spec.prompt_token_ids)
        produced = 0
        try:
            while True:
                await asyncio.sleep(self.step_s)
                while not self.running.is_set() and spec.request_id not in self.aborted:
                    await asyncio.sleep(self.step_s)  # paused: frozen, but an abort still ends it
                if spec.request_id in self.aborted:
                    yield SegmentEvent([], [], finish=Finish.ABORT)
                    return
                token = next_token(context, self.salt(spec.adapter))
                context.append(token)
                produced += 1
                finish = Finish.LENGTH if produced >= spec.sampling.max_tokens else None
                yield SegmentEvent([token], [-1.0], finish=finish)
                if finish is not None:
                    return
        finally:
            self.live.discard(spec.request_id)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.update(r for r in request_ids if r in self.live)

    async def pause(self) -> None:
        self.calls.append("pause")
        self.running.clear()

    async def resume(self) -> None:
        self.calls.append("resume")
        self.running.set()

    async def add_adapter(self, handle: AdapterHandle, lora: LoraSpec, tensors: Mapping[str, torch.Tensor]
                          ) -> None:
        if self.fail_add_adapter is not None:
            raise self.fail_add_adapter
        self.adapters[handle.lora_int_id] = handle
        self.calls.append(f"add {handle.name}")

    async def remove_adapter(self, handle: AdapterHandle) -> None:
        self.adapters.pop(handle.lora_int_id, None)
        self.calls.append(f"remove {handle.name}")

    async def stage_weights(self, token: str, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.staged[token] = dict(weights)

    async def drop_weights(self, token: str) -> None:
        self.staged.pop(token, None)

    async def load_weights(self, token: str, label: str) -> None:
        assert not self.running.is_set(), "weights must be swapped while paused"
        assert not self.live, f"segments still running during a swap: {self.live}"
        self.staged.pop(token)
        self.label = label
        self.calls.append(f"load {label}")

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.live), waiting=0, peak_running=self.peak)
