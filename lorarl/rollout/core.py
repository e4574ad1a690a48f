"""The rollout replica, engine-neutral: generation with exact per-token versions, and policy updates.

Two parts over one engine, one policy table and one switch gate:
- lorarl.rollout.segments `SegmentRunner`: completions as engine segments, each under one policy,
  so every token is tagged with the version that produced it;
- lorarl.rollout.policy_manager `PolicyManager`: staging, committing and unloading versions
  (adapters side by side, merged weights switched between engine steps).
This class wires them together and is what the servicer, the weight-sync sink and the tests use.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lorarl.common.errors import FailedPreconditionError
from lorarl.contract.transfer_ranks import merges_locally
from lorarl.rollout import teachers
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.engine_api import GenerationEngine
from lorarl.rollout.gate import SwitchGate
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.payloads import PolicyPayload
from lorarl.rollout.policies import PolicyTable, State
from lorarl.rollout.policy_manager import PolicyManager
from lorarl.rollout.prompts import PromptRenderer
from lorarl.rollout.schema import LATEST, CompletionChunk, EngineInfo, GenerateInput, Mode, PromptResult
from lorarl.rollout.segments import SegmentRunner
from lorarl.rollout.teacher_engines import TeacherEngines
from lorarl.v1 import common_pb2


@dataclass(frozen=True)
class LoadedPolicyStatus:
    job_id: str
    version: int
    mode: Mode
    state: State
    in_flight: int
    active: bool


@dataclass(frozen=True)
class ReplicaStatus:
    policies: list[LoadedPolicyStatus]
    paused: bool
    in_flight: int
    queued: int
    peak_running: int


class RolloutCore:
    """Generation and policy management of one replica on top of any GenerationEngine."""

    def __init__(self, engine: GenerationEngine, settings: RolloutSettings, files: ModelFiles,
                 fingerprint: str, renderer: PromptRenderer | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.files = files
        self.fingerprint = fingerprint
        self.renderer = renderer
        self.table = PolicyTable(window=settings.window, capacity=max(1, settings.max_loras))
        gate = SwitchGate()
        self.runner = SegmentRunner(engine, settings, self.table, gate, renderer,
                                    on_drained=lambda loaded: self.policies.unload_if_drained(loaded))
        self.policies = PolicyManager(engine, settings, self.table, gate, files, fingerprint, self.runner)
        #: full-model teachers' engines (rollout.teacher_engines; set by the server, which holds the stack's token)
        self.teacher_engines: TeacherEngines | None = None

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    async def close(self) -> None:
        self.runner.close()
        await self.engine.close()

    async def wait_dead(self) -> str:
        return await self.engine.wait_dead()

    # ------------------------------------------------------------ generation (segments.py)

    async def generate(self, request: GenerateInput) -> list[PromptResult]:
        return await self.runner.generate(request)

    async def generate_scored(self, request: GenerateInput) -> tuple[list[PromptResult], float]:
        """Generate, then the request's teachers score its completions in this engine (lorarl.rollout.teachers);
        the results and the seconds scoring took."""
        results = await self.runner.generate(request)
        return results, await self.score(request, results)

    async def score(self, request: GenerateInput, results: list[PromptResult]) -> float:
        """The request's teachers score ``results``' completions (each completion's ``teacher_logprobs`` set in
        place): after Generate, or after a streamed turn of a scored session (lorarl.rollout.openai); the seconds
        it took."""
        return await teachers.score(self._score_rows, request, results)

    async def _score_rows(self, rows: GenerateInput) -> list[PromptResult]:
        """One teacher's scoring rows: in this engine, or on the teacher's own engine (a full-model teacher)."""
        if not rows.policy.engine:
            return await self.runner.generate(rows)
        if self.teacher_engines is None:
            raise FailedPreconditionError(f"{rows.policy} is not reachable from this replica (no "
                                          "rollout.teacher_engines)")
        return await self.teacher_engines.generate(rows)

    def generate_stream(self, request: GenerateInput) -> AsyncIterator[CompletionChunk]:
        return self.runner.generate_stream(request)

    def decode(self, token_ids: list[int]) -> str:
        return self.runner.decode(token_ids)

    async def pause(self) -> None:
        await self.runner.pause()

    async def resume(self) -> None:
        await self.runner.resume()

    async def abort(self, request_ids: list[str]) -> int:
        return await self.runner.abort(request_ids)

    # ------------------------------------------------------------ policies (policy_manager.py)

    async def load(self, payload: PolicyPayload) -> None:
        await self.policies.load(payload)

    async def stage(self, payload: PolicyPayload) -> None:
        await self.policies.stage(payload)

    async def receive_in_engine(self, manifest: common_pb2.WeightManifest, rendezvous: Mapping[str, Any],
                                key: bytes | None, serve_mode: int) -> Mapping[str, torch.Tensor] | None:
        """Has the engine's worker receive a collective transfer itself (rollout.receive_in_worker); None
        where this engine does not, or the version must pass through here (a local merge reads values)."""
        receive = getattr(self.engine, "receive_in_worker", None)
        if receive is None or not getattr(self.engine, "receives_in_worker", False):
            return None
        if merges_locally(manifest.mode, serve_mode):
            return None
        token = f"{manifest.job_id}-v{manifest.version}-recv-{uuid.uuid4().hex[:8]}"
        return await receive(token, manifest.SerializeToString(), rendezvous, key)

    async def commit(self, job_id: str, version: int) -> None:
        await self.policies.commit(job_id, version)

    async def abort_staged(self, job_id: str, version: int) -> None:
        await self.policies.abort_staged(job_id, version)

    async def unload(self, job_id: str, version: int = LATEST) -> None:
        await self.policies.unload(job_id, version)

    def active_versions(self) -> dict[str, int]:
        return self.table.active_versions()

    def status(self) -> ReplicaStatus:
        stats = self.engine.stats()
        active = self.table.active_versions()
        policies = [LoadedPolicyStatus(v.job_id, v.version, v.mode, v.state, v.in_flight,
                                       active.get(v.job_id) == v.version) for v in self.table.all_versions()]
        return ReplicaStatus(policies=policies, paused=self.runner.client_paused, in_flight=self.runner.in_flight,
                             queued=max(0, self.runner.admitted - stats.running), peak_running=stats.peak_running)
