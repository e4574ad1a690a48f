"""The rollout side of weight sync: a PolicySink (lorarl/weightsync/client/sinks.py) over the rollout core.

The weight-sync agent calls a sink from worker threads, one call at a time; the core lives on the
service's event loop, so each call is run there and waited for. Wiring a replica to weight sync is
then `WeightSyncAgent(target, RolloutSink(core, loop), ...)`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import torch

from lorarl.rollout.convert import policy_payload
from lorarl.rollout.core import RolloutCore
from lorarl.v1 import common_pb2
from lorarl.weightsync.client.sinks import PolicyUpdate

T = TypeVar("T")


class RolloutSink:
    """PolicySink: stage -> core.stage (refusals leave the served version alone), commit, abort, active_versions."""

    def __init__(self, core: RolloutCore, loop: asyncio.AbstractEventLoop, timeout_s: float | None = 600.0) -> None:
        self.core = core
        self.loop = loop
        self.timeout_s = timeout_s

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.loop.is_running() and threading.get_ident() == getattr(self.loop, "_thread_id", None):
            coro.close()
            raise RuntimeError("RolloutSink methods block: call them from a worker thread, not the core's loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def active_versions(self) -> dict[str, int]:
        async def read() -> dict[str, int]:
            return self.core.active_versions()

        return self._run(read())

    def receive_in_engine(self, manifest: common_pb2.WeightManifest, rendezvous: Mapping[str, Any],
                          key: bytes | None, serve_mode: int) -> Mapping[str, torch.Tensor] | None:
        """The engine's worker receives the transfer itself (RolloutCore.receive_in_engine); None: it does not."""
        return self._run(self.core.receive_in_engine(manifest, rendezvous, key, serve_mode))

    def stage(self, update: PolicyUpdate) -> None:
        self._run(self.core.stage(policy_payload(update.manifest, update.tensors, update.serve_mode)))

    def commit(self, job_id: str, version: int) -> None:
        self._run(self.core.commit(job_id, version))

    def abort(self, job_id: str, version: int) -> None:
        self._run(self.core.abort_staged(job_id, version))
