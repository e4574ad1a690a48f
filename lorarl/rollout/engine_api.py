"""The contract every generation engine implements (vLLM, transformers, test fakes).

The rollout core (lorarl/rollout/core.py) owns policies, versions, version tags and the
switch protocol; an engine only runs *segments* (one prompt, n = 1, one fixed policy), loads
and drops adapters, and swaps full weights when told to. That split keeps the tricky parts
(which version produced which token, what to resubmit after a switch) in one engine-neutral
place that unit tests can drive with a fake engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from lorarl.contract.lora import LoraSpec
from lorarl.rollout.schema import AdapterHandle, EngineInfo, EngineStats, SegmentEvent, SegmentSpec


@runtime_checkable
class GenerationEngine(Protocol):
    """A started engine; all methods run on the service's event loop.

    Optional: ``loaded_weight_names``, the checkpoint names whose tensors the engine's loader writes
    into a parameter (None or absent: all of them); a merged update naming any other fails.
    """

    info: EngineInfo

    async def start(self) -> None:
        """Loads the model; `info` is valid afterwards."""
        ...

    async def close(self) -> None: ...

    async def wait_dead(self) -> str:
        """Returns (why) once the engine cannot serve any more, e.g. vLLM's engine core died; never for
        an engine that lives in this process."""
        ...

    async def submit(self, spec: SegmentSpec) -> AsyncIterator[SegmentEvent]:
        """Queues one segment; the request is in the engine when this returns.

        The iterator yields new tokens and ends after the event carrying `finish` (with
        `spec.stream` false it may hold everything back for that last event, aborted or not).
        Closing it early (or cancelling its consumer) aborts the request.
        """
        ...

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Ends these segments now; each still yields a last event with Finish.ABORT."""
        ...

    async def pause(self) -> None:
        """Stops scheduling: requests in flight stay where they are, new ones queue."""
        ...

    async def resume(self) -> None: ...

    async def add_adapter(self, handle: AdapterHandle, lora: LoraSpec, tensors: Mapping[str, torch.Tensor]
                          ) -> None:
        """Loads an adapter (PEFT tensor names) under `handle`; raises if the engine refuses it."""
        ...

    async def remove_adapter(self, handle: AdapterHandle) -> None: ...

    async def stage_weights(self, token: str, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Holds a complete set of checkpoint-named weights ready for `load_weights` (not served yet)."""
        ...

    async def drop_weights(self, token: str) -> None: ...

    async def load_weights(self, token: str, label: str) -> None:
        """Replaces the model's weights with staged ones; the caller has paused and drained the engine."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    def stats(self) -> EngineStats: ...
