"""GenerationEngine on plain transformers: for machines without vLLM, and to cross-check vLLM.

Same contract as VllmEngine, simpler machinery: segments take turns one decoding step at a time
(each step runs in a worker thread under one lock), each with its own KV cache. No continuous
batching, so throughput is far below vLLM's; outputs are what transformers computes, which makes
this engine the reference in parity tests (fp32 greedy: same tokens as vLLM for base, adapter and
merged policies).

Adapters are applied with forward hooks on the adapted nn.Linear modules (y += B(A(x)) * scale,
PEFT's formula), several adapters side by side, the one of the segment being stepped active.
Merged weights are copied into the model's parameters; per-expert checkpoint names of MoE models
are written into transformers' fused expert tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lorarl.contract.lora import LoraSpec
from lorarl.contract.peft import pair_tensors
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.schema import (
    AdapterHandle,
    EngineInfo,
    EngineStats,
    Finish,
    Sampling,
    SegmentEvent,
    SegmentSpec,
)

_EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Segment:
    spec: SegmentSpec
    generator: torch.Generator | None
    aborted: bool = False
    produced: list[int] = field(default_factory=list)


def choose_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None, processed: bool
                 ) -> tuple[int, float, dict[int, float]]:
    """Samples one token like vLLM: temperature, top-k, top-p; returns (token, its logprob, top-n logprobs)."""
    logits = logits.float()
    if sampling.temperature == 0:
        scores = logits
        token = int(torch.argmax(scores))
    else:
        scores = logits / sampling.temperature
        if sampling.top_k > 0:
            kth = torch.topk(scores, min(sampling.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if sampling.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(ordered, -1).cumsum(-1)
            drop = cumulative - torch.softmax(ordered, -1) > sampling.top_p
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        token = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=generator))
    logprobs = torch.log_softmax(scores if processed else logits, -1)
    top: dict[int, float] = {}
    if sampling.logprobs > 0:
        values, ids = torch.topk(logprobs, sampling.logprobs)
        top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return token, float(logprobs[token]), top


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top: int) -> tuple[list[float], list[dict[int, float]]]:
    """Each prompt token's raw logprob given the tokens before it (the first NaN: nothing predicts it), as vLLM's
    prompt logprobs are, and with ``top`` > 0 the most likely tokens at each position (the first empty)."""
    logprobs = torch.log_softmax(logits[:-1].float(), -1)
    targets = torch.tensor(ids[1:], dtype=torch.long)
    chosen = [float("nan"), *logprobs.gather(1, targets[:, None])[:, 0].tolist()]
    tops: list[dict[int, float]] = []
    if top > 0:
        values, indices = torch.topk(logprobs, top, -1)
        tops = [{}, *({int(i): float(v) for i, v in zip(row_i, row_v, strict=True)}
                     for row_i, row_v in zip(indices, values, strict=True))]
    return chosen, tops


class HfEngine:
    """GenerationEngine backed by transformers (see module docstring)."""

    serves_prompt_logprobs = True  # SamplingParams.prompt_logprobs: from the prompt's own forward pass

    def __init__(self, settings: RolloutSettings) -> None:
        if settings.model_path is None:
            raise ValueError("rollout.model_path is required to start an engine")
        self.settings = settings
        self.files = ModelFiles(settings.model_path)
        self.info: EngineInfo
        self.model: Any = None
        self._lock = asyncio.Lock()
        self._running = asyncio.Event()
        self._running.set()
        self._segments: dict[str, _Segment] = {}
        self._adapters: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self._hooked: set[str] = set()
        self._active_adapter: int | None = None
        self._staged: dict[str, dict[str, torch.Tensor]] = {}
        self._peak = 0
        self._renderer: Any = None

    async def start(self) -> None:
        from transformers import AutoModelForCausalLM

        s = self.settings
        dtype = _DTYPES.get(s.dtype, "auto")
        self.model = await asyncio.to_thread(
            lambda: AutoModelForCausalLM.from_pretrained(str(self.files.root), dtype=dtype).to(s.device).eval())
        supported = not self.files.is_moe and s.enable_lora is not False
        reason = "" if supported else (
            "the hf engine adapts nn.Linear modules only and MoE experts are fused tensors; serve merged weights"
            if self.files.is_moe else "the engine was started with rollout.enable_lora=false")
        self.info = EngineInfo(
            engine="hf", model_path=str(self.files.root), architecture=self.files.architecture,
            vocab_size=self.files.vocab_size,
            max_model_len=s.max_model_len or self.files.max_position_embeddings,
            eos_token_ids=self.files.eos_token_ids, is_moe=self.files.is_moe, supports_lora=supported,
            lora_reason=reason, max_lora_rank=s.max_lora_rank if supported else 0,
            max_loras=s.max_loras if supported else 0, dtype=str(self.model.dtype).removeprefix("torch."))

    async def close(self) -> None:
        self.model = None

    async def wait_dead(self) -> str:
        await asyncio.Event().wait()  # it runs in this process: it dies with it
        return ""

    # ---------------------------------------------------------------------------- requests

    async def submit(self, spec: SegmentSpec) -> AsyncIterator[SegmentEvent]:
        if spec.adapter is not None and spec.adapter.lora_int_id not in self._adapters:
            raise RuntimeError(f"adapter {spec.adapter.name} is not loaded in the engine")
        generator = None
        if spec.sampling.seed is not None:
            generator = torch.Generator().manual_seed(spec.sampling.seed)
        segment = _Segment(spec, generator)
        self._segments[spec.request_id] = segment
        self._peak = max(self._peak, len(self._segments))
        return self._decode(segment)

    async def _decode(self, segment: _Segment) -> AsyncIterator[SegmentEvent]:
        spec = segment.spec
        ids = list(spec.prompt_token_ids)
        past: Any = None
        try:
            while True:
                while not self._running.is_set() and not segment.aborted:
                    await asyncio.sleep(0.005)  # paused: frozen, but an abort still ends the segment
                if segment.aborted:
                    yield SegmentEvent([], [], finish=Finish.ABORT)
                    return
                async with self._lock:
                    if segment.aborted:
                        continue
                    first = past is None
                    token, logprob, top, past, logits = await asyncio.to_thread(
                        self._step, spec, ids, past, segment.generator)
                segment.produced.append(token)
                finish = self._finish(spec.sampling, segment.produced)
                event = SegmentEvent([token], [logprob], [top] if spec.sampling.logprobs > 0 else [], finish)
                if first and spec.sampling.prompt_logprobs:
                    event.prompt_logprobs, event.prompt_top_logprobs = prompt_logprobs(logits, ids,
                                                                                       spec.sampling.logprobs)
                yield event
                if finish is not None:
                    return
                ids = [token]
        finally:
            self._segments.pop(spec.request_id, None)

    @torch.no_grad()
    def _step(self, spec: SegmentSpec, ids: list[int], past: Any, generator: torch.Generator | None
              ) -> tuple[int, float, dict[int, float], Any, torch.Tensor]:
        self._active_adapter = spec.adapter.lora_int_id if spec.adapter is not None else None
        try:
            device = next(self.model.parameters()).device
            out = self.model(input_ids=torch.tensor([ids], device=device), past_key_values=past, use_cache=True)
        finally:
            self._active_adapter = None
        processed = self.settings.logprobs_mode == "processed_logprobs"
        wants_prompt = past is None and spec.sampling.prompt_logprobs  # every position's logits, this once
        logits = out.logits[0].cpu() if wants_prompt else out.logits[0, -1:].cpu()
        token, logprob, top = choose_token(logits[-1], spec.sampling, generator, processed)
        return token, logprob, top, out.past_key_values, logits

    def _finish(self, sampling: Sampling, produced: list[int]) -> Finish | None:
        token = produced[-1]
        if (token in self.info.eos_token_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids:
            return Finish.STOP
        if sampling.stop:
            if self._renderer is None:
                from lorarl.rollout.prompts import PromptRenderer

                self._renderer = PromptRenderer(self.files.root)
            if any(stop in self._renderer.decode(produced) for stop in sampling.stop):
                return Finish.STOP
        if len(produced) >= sampling.max_tokens:
            return Finish.LENGTH
        return None

    async def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            if (segment := self._segments.get(request_id)) is not None:
                segment.aborted = True

    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def reset_prefix_cache(self) -> None:
        """Nothing to reset: each segment has its own KV cache."""

    def stats(self) -> EngineStats:
        running = len(self._segments) if self._running.is_set() else 0
        return EngineStats(running=running, waiting=len(self._segments) - running, peak_running=self._peak)

    # ---------------------------------------------------------------------------- adapters

    async def add_adapter(self, handle: AdapterHandle, lora: LoraSpec, tensors: Mapping[str, torch.Tensor]
                          ) -> None:
        modules = pair_tensors(tensors)
        named = dict(self.model.named_modules())
        device, dtype = next(self.model.parameters()).device, next(self.model.parameters()).dtype
        adapter: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for module_name, (lora_a, lora_b) in modules.items():
            if not isinstance(named.get(module_name), nn.Linear):
                raise ValueError(f"{module_name} is not a linear layer of this model")
            a = lora_a.detach().to(device=device, dtype=dtype).clone()
            b = lora_b.detach().to(device=device, dtype=dtype).clone()
            adapter[module_name] = (a, b, lora.scale)
        async with self._lock:
            for module_name in adapter:
                if module_name not in self._hooked:
                    named[module_name].register_forward_hook(self._hook(module_name))
                    self._hooked.add(module_name)
            self._adapters[handle.lora_int_id] = adapter

    def _hook(self, module_name: str) -> Any:
        def add_lora(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
            adapter = self._adapters.get(self._active_adapter) if self._active_adapter is not None else None
            weights = adapter.get(module_name) if adapter else None
            if weights is None:
                return None
            a, b, scale = weights
            return output + (inputs[0] @ a.T @ b.T) * scale

        return add_lora

    async def remove_adapter(self, handle: AdapterHandle) -> None:
        async with self._lock:
            self._adapters.pop(handle.lora_int_id, None)

    # ----------------------------------------------------------------------------- weights

    async def stage_weights(self, token: str, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        staged = await asyncio.to_thread(lambda: {n: t.detach().to("cpu").clone() for n, t in weights})
        self._check_names(staged)
        self._staged[token] = staged

    async def drop_weights(self, token: str) -> None:
        self._staged.pop(token, None)

    async def load_weights(self, token: str, label: str) -> None:
        staged = self._staged.pop(token)
        async with self._lock:
            await asyncio.to_thread(self._copy_in, staged)

    def _targets(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters(remove_duplicate=False))

    def _check_names(self, weights: Mapping[str, torch.Tensor]) -> None:
        params = self._targets()
        for name in weights:
            expert = _EXPERT_NAME.match(name)
            fused = f"{expert['prefix']}.{'down_proj' if expert['proj'] == 'down_proj' else 'gate_up_proj'}" \
                if expert else None
            if name not in params and fused not in params and not (name == "lm_head.weight"
                                                                   and self.files.tie_word_embeddings):
                raise ValueError(f"{name} is not a weight of this model")

    @torch.no_grad()
    def _copy_in(self, weights: Mapping[str, torch.Tensor]) -> None:
        params = self._targets()
        for name, tensor in weights.items():
            expert = _EXPERT_NAME.match(name)
            if name in params:
                params[name].copy_(tensor)
            elif expert is not None:
                e, proj = int(expert["expert"]), expert["proj"]
                if proj == "down_proj":
                    params[f"{expert['prefix']}.down_proj"][e].copy_(tensor)
                else:
                    gate_up = params[f"{expert['prefix']}.gate_up_proj"][e]
                    inter = gate_up.shape[0] // 2
                    (gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]).copy_(tensor)
            else:
                with contextlib.suppress(KeyError):  # a tied lm_head: its weight is the embedding's
                    params[name].copy_(tensor)
