"""The policy manager: which versions a replica holds, and how each one goes live.

Adapter versions are loaded side by side and an old version is unloaded once its last request has
finished; committing one makes no engine call at all, so it does not wait for the engine's current
step. Switches of the engine's own weights (merged mode) run under the SwitchGate: submissions are
held, the engine is paused, the segments in flight are interrupted and drained (the runner resubmits
them under the new version), weights are reloaded between engine steps, the prefix cache is reset,
and the engine resumes.

Failures while staging leave everything as it was: the previous version keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from lorarl.common.errors import FailedPreconditionError, NotFoundError
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.engine_api import GenerationEngine
from lorarl.rollout.gate import SwitchGate
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.payloads import (
    PolicyPayload,
    check_adapter,
    check_loadable,
    check_merged,
    complete_weights,
    merge_adapter,
)
from lorarl.rollout.policies import LoadedVersion, PolicyTable, State
from lorarl.rollout.schema import LATEST, AdapterHandle, Mode, PolicyRef
from lorarl.rollout.segments import SegmentRunner

logger = logging.getLogger(__name__)

BASE_LABEL = "base"
#: Bound on waiting for interrupted segments to hand back their last tokens during a switch.
DRAIN_TIMEOUT_S = 60.0
NO_RANK_LIMIT = 1 << 30


class PolicyManager:
    """Stages, commits and unloads the policy versions of one replica."""

    def __init__(self, engine: GenerationEngine, settings: RolloutSettings, table: PolicyTable, gate: SwitchGate,
                 files: ModelFiles, fingerprint: str, runner: SegmentRunner) -> None:
        self.engine = engine
        self.settings = settings
        self.table = table
        self.files = files
        self.fingerprint = fingerprint
        self.runner = runner
        self._gate = gate
        self._policy_lock = asyncio.Lock()

    async def load(self, payload: PolicyPayload) -> None:
        """Stage and commit in one step (the LoadWeights RPC)."""
        await self.stage(payload)
        await self.commit(payload.job_id, payload.version)

    async def stage(self, payload: PolicyPayload) -> None:
        """Prepares a version without serving it; raises (changing nothing) if it cannot be served here."""
        try:
            await self._stage(payload)
        except BaseException:
            received = getattr(payload.tensors, "engine_token", None)
            if received is not None:  # refused before the engine adopted what its worker received
                await self.engine.drop_received(received)  # type: ignore[attr-defined]
            raise

    async def _stage(self, payload: PolicyPayload) -> None:
        async with self._policy_lock:
            if payload.fingerprint and payload.fingerprint != self.fingerprint:
                raise FailedPreconditionError(f"{payload.job_id} v{payload.version} was made for base model "
                                              f"{payload.fingerprint}, this replica serves {self.fingerprint}")
            self.table.check_stage(payload.job_id, payload.version, payload.serve_mode)
            if payload.serve_mode is not Mode.ADAPTER and (why := self.settings.base_write_refusal()):
                how = "an adapter merged locally" if payload.local_merge else "merged weights"
                raise FailedPreconditionError(
                    f"{payload.job_id} v{payload.version} would replace this engine's base weights ({how}); {why}")
            previous = self.table.staged(payload.job_id)
            if payload.serve_mode is Mode.ADAPTER:
                await self._stage_adapter(payload, previous)
            else:
                await self._stage_merged(payload, previous)
            logger.info("staged %s v%d (%s)", payload.job_id, payload.version, payload.serve_mode.value)

    async def _stage_adapter(self, payload: PolicyPayload, previous: LoadedVersion | None) -> None:
        info = self.engine.info
        if payload.mode is not Mode.ADAPTER or payload.lora is None:
            raise FailedPreconditionError("only an adapter payload (with its LoRA spec) can be served as an adapter")
        if not info.supports_lora:
            raise FailedPreconditionError(f"this replica cannot serve LoRA adapters: {info.lora_reason}")
        lora = check_adapter(payload.tensors, payload.lora, self.files, info.max_lora_rank)
        if previous is not None:
            await self._unload(previous)
        for victim in self.table.make_room(payload.job_id):
            await self._unload(victim)
        handle = AdapterHandle(name=f"{payload.job_id}-v{payload.version}", lora_int_id=self.table.new_adapter_id(),
                               rank=lora.rank)
        try:
            await self.engine.add_adapter(handle, lora, payload.tensors)
        except Exception as exc:
            raise FailedPreconditionError(f"the engine refused {handle.name}: {exc}") from exc
        self.table.add(LoadedVersion(payload.job_id, payload.version, Mode.ADAPTER, adapter=handle,
                                     weights=payload.weights))

    async def _stage_merged(self, payload: PolicyPayload, previous: LoadedVersion | None) -> None:
        received = getattr(payload.tensors, "engine_token", None)  # already in the engine's worker
        tensors = dict(payload.tensors)
        if payload.local_merge:
            if payload.lora is None:
                raise FailedPreconditionError("a local merge needs the adapter's LoRA spec")
            lora = check_adapter(tensors, payload.lora, self.files, NO_RANK_LIMIT)
            tensors = await asyncio.to_thread(merge_adapter, tensors, lora, self.files)
        check_merged(tensors, self.files)
        loaded = getattr(self.engine, "loaded_weight_names", None)
        check_loadable(tensors, loaded, self.engine.info.engine)
        if previous is not None:
            await self._unload(previous)
        token = f"{payload.job_id}-v{payload.version}-{uuid.uuid4().hex[:8]}"
        weights = complete_weights(tensors, self.files, loaded)
        if received is not None:
            await self.engine.stage_weights(token, weights, received=received)  # type: ignore[call-arg]
        else:
            await self.engine.stage_weights(token, weights)
        self.table.add(LoadedVersion(payload.job_id, payload.version, Mode.MERGED, weights_token=token,
                                     weights=payload.weights))

    async def commit(self, job_id: str, version: int) -> None:
        """Serves a staged version from now on (see module docstring for what happens to requests in flight)."""
        async with self._policy_lock:
            loaded = self.table.get(job_id, version)
            if loaded is None or loaded.state is not State.STAGED:
                raise NotFoundError(f"{job_id} v{version} is not staged on this replica")
            if loaded.mode is Mode.MERGED:
                assert loaded.weights_token is not None
                await self._switch_weights(loaded.weights_token, f"{job_id}:v{version}",
                                           lambda: self.table.commit(job_id, version))
                loaded.weights_token = None
            else:
                # No engine round trip here (the engine is usually mid-batch): retired versions are unloaded
                # once this commit has returned, and the prefix cache needs no reset because every
                # adapter load has its own key (AdapterHandle.key).
                for drained in self.table.commit(job_id, version):
                    self.runner.spawn(self.unload_if_drained(drained))
                if self.settings.update_policy == "continue":
                    await self.runner.interrupt(lambda s: s.sequence.request.policy == PolicyRef(job_id, LATEST)
                                          and s.policy.job_id == job_id and s.policy.version != version)
            logger.info("serving %s v%d", job_id, version)

    async def abort_staged(self, job_id: str, version: int) -> None:
        async with self._policy_lock:
            loaded = self.table.get(job_id, version)
            if loaded is not None and loaded.state is State.STAGED:
                await self._unload(loaded)

    async def unload(self, job_id: str, version: int = LATEST) -> None:
        """Unloads a job (version 0) or one version; adapters go once their requests have finished.

        Unloading a merged job puts the pristine base weights back.
        """
        async with self._policy_lock:
            if self.table.job_mode(job_id) is Mode.MERGED:
                merged = self.table.merged
                if version != LATEST and self.table.get(job_id, version) is None:
                    raise NotFoundError(f"{job_id} v{version} is not loaded on this replica")
                if merged is not None and merged.job_id == job_id and version in (LATEST, merged.version):
                    token = f"base-{uuid.uuid4().hex[:8]}"
                    await self.engine.stage_weights(token, self.files.tensors())
                    await self._switch_weights(token, BASE_LABEL, lambda: self.table.remove(merged))
                for v in self.table.all_versions():
                    if v.job_id == job_id and version in (LATEST, v.version):
                        await self._unload(v)
                return
            drained, busy = self.table.retire_job(job_id, version)
            for v in drained:
                await self._unload(v)
            if busy:
                logger.info("unloading %s after their requests finish", ", ".join(map(str, busy)))

    async def _unload(self, loaded: LoadedVersion) -> None:
        self.table.remove(loaded)
        try:
            if loaded.adapter is not None:
                await self.engine.remove_adapter(loaded.adapter)
            if loaded.weights_token is not None:
                await self.engine.drop_weights(loaded.weights_token)
        except Exception:
            logger.exception("unloading %s failed", loaded)

    async def unload_if_drained(self, loaded: LoadedVersion) -> None:
        """Unloads a retiring version once its last request has finished (the runner reports it)."""
        async with self._policy_lock:
            if self.table.get(loaded.job_id, loaded.version) is loaded and loaded.state is State.RETIRING \
                    and loaded.in_flight == 0:
                await self._unload(loaded)

    async def _switch_weights(self, token: str, label: str, on_loaded: Callable[[], object]) -> None:
        """Replaces the engine's weights between steps (see module docstring)."""
        async with self._gate.switch():
            await self.engine.pause()
            try:
                victims = await self.runner.interrupt(lambda _s: True)
                if victims:
                    await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in victims)), DRAIN_TIMEOUT_S)
                await self.engine.load_weights(token, label)
                on_loaded()
                await self.engine.reset_prefix_cache()
            finally:
                if not self.runner.client_paused:
                    await self.engine.resume()

