"""The rollout replica, engine-neutral: generation with exact per-token versions, and policy updates.

A completion runs as one or more engine *segments*. Each segment is decoded under one fixed policy,
so every token is tagged with the version that produced it. When a weight switch interrupts a
segment (merged mode always; adapter mode with update_policy 'continue'), the completion is
resubmitted as prompt + tokens so far under the new version and the tags change mid-sequence.
A request pinned to a version that is no longer loaded ends with Finish.ABORT instead.

Switches of the engine's weights (merged mode) run under the SwitchGate: submissions are held,
the engine is paused, affected segments are aborted and drained, weights are reloaded between
engine steps, the prefix cache is reset, and the engine resumes. Adapter versions need no pause:
they are loaded side by side and an old version is unloaded once its last request has finished;
committing one makes no engine call at all, so it does not wait for the engine's current step.

Failures while staging leave everything as it was: the previous version keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from services.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
    ServiceError,
)
from services.rollout.config import RolloutSettings
from services.rollout.engine_api import GenerationEngine
from services.rollout.gate import SwitchGate
from services.rollout.model_files import ModelFiles
from services.rollout.payloads import (
    PolicyPayload,
    check_adapter,
    check_merged,
    complete_weights,
    merge_adapter,
)
from services.rollout.policies import LoadedVersion, PolicyTable, State
from services.rollout.prompts import PromptRenderer
from services.rollout.schema import (
    LATEST,
    AdapterHandle,
    Completion,
    CompletionChunk,
    EngineInfo,
    Finish,
    GenerateInput,
    Mode,
    PolicyRef,
    PromptResult,
    SegmentSpec,
    ServedPolicy,
)

logger = logging.getLogger(__name__)

BASE_LABEL = "base"
#: Bound on waiting for interrupted segments to hand back their last tokens during a switch.
DRAIN_TIMEOUT_S = 60.0
NO_RANK_LIMIT = 1 << 30


@dataclass
class _Sequence:
    """One completion (prompt x one of n) across its segments."""

    key: str
    index: int
    prompt: tuple[int, ...]
    request: GenerateInput
    emit: Callable[[CompletionChunk], None]
    stream: bool
    completion: Completion = field(default_factory=Completion)
    cancelled: bool = False


@dataclass
class _Segment:
    engine_id: str
    sequence: _Sequence
    policy: ServedPolicy
    interrupted: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


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
        self.renderer = renderer
        self.settings = settings
        self.files = files
        self.fingerprint = fingerprint
        self.table = PolicyTable(window=settings.window, capacity=max(1, settings.max_loras))
        self._gate = SwitchGate()
        self._policy_lock = asyncio.Lock()
        self._live: dict[str, _Segment] = {}
        self._requests: dict[str, list[_Sequence]] = {}
        self._admitted = 0
        self._client_paused = False
        self._background: set[asyncio.Task[None]] = set()

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.engine.close()

    # ============================================================================ generation

    @contextlib.contextmanager
    def _admit(self, request: GenerateInput, count: int) -> Iterator[None]:
        limit = self.settings.max_queued_requests
        if self._admitted + count > limit:
            raise ResourceExhaustedError(f"{self._admitted} sequences in flight and this request adds {count}; "
                                         f"the limit is {limit} (rollout.max_queued_requests): retry later")
        if request.request_id in self._requests:
            raise AlreadyExistsError(f"request {request.request_id!r} is already in flight")
        self._admitted += count
        try:
            yield
        finally:
            self._admitted -= count
            self._requests.pop(request.request_id, None)

    def _sequences(self, request: GenerateInput, emit: Callable[[CompletionChunk], None] | None,
                   prompt_index: int, prompt: tuple[int, ...]) -> list[_Sequence]:
        """One _Sequence per completion; without `emit` (unary calls) tokens only need to arrive at the end."""
        return [_Sequence(key=f"{request.request_id}/{prompt_index}.{i}", index=i, prompt=prompt, request=request,
                          emit=emit or _ignore, stream=emit is not None) for i in range(request.sampling.n)]

    async def generate(self, request: GenerateInput) -> list[PromptResult]:
        """All completions of all prompts; they run concurrently, so the engine batches them."""
        self.table.resolve(request.policy)  # NOT_FOUND / FAILED_PRECONDITION before any work
        per_prompt = [self._sequences(request, None, p, prompt)
                      for p, prompt in enumerate(request.prompts)]
        sequences = [s for group in per_prompt for s in group]
        with self._admit(request, len(sequences)):
            self._requests[request.request_id] = sequences
            await _run_all([self._run_sequence(s) for s in sequences])
        results = []
        for prompt, group in zip(request.prompts, per_prompt, strict=True):
            for s in group:
                s.completion.text = self.decode(s.completion.token_ids)
            results.append(PromptResult(list(prompt), [s.completion for s in group]))
        return results

    async def generate_stream(self, request: GenerateInput) -> AsyncIterator[CompletionChunk]:
        """Chunks of the n completions of one prompt as they are produced; each ends with a `finish` chunk."""
        self.table.resolve(request.policy)
        queue: asyncio.Queue[CompletionChunk | BaseException | None] = asyncio.Queue()
        sequences = self._sequences(request, queue.put_nowait, 0, request.prompts[0])
        with self._admit(request, len(sequences)):
            self._requests[request.request_id] = sequences

            async def run() -> None:
                try:
                    await _run_all([self._run_sequence(s) for s in sequences])
                    queue.put_nowait(None)
                except BaseException as exc:  # handed to the consumer, which re-raises it
                    queue.put_nowait(exc)

            runner = asyncio.create_task(run())
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner

    async def _run_sequence(self, seq: _Sequence) -> None:
        """Decodes one completion, resubmitting it after each interruption by a switch."""
        sampling = seq.request.sampling
        segment_no = 0
        while True:
            done = len(seq.completion.token_ids)
            remaining = sampling.max_tokens - done
            if seq.cancelled or remaining <= 0:
                self._finish(seq, Finish.ABORT if seq.cancelled else Finish.LENGTH)
                return
            async with self._gate.submitting():
                try:
                    policy = self.table.resolve(seq.request.policy)
                except ServiceError as exc:
                    if segment_no == 0:
                        raise
                    logger.info("%s cannot continue after a switch: %s", seq.key, exc)
                    self._finish(seq, Finish.ABORT)
                    return
                seed = None if sampling.seed is None else sampling.seed + seq.index + 7919 * segment_no
                segment = _Segment(f"{seq.key}/{segment_no}", seq, policy)
                spec = SegmentSpec(segment.engine_id, seq.prompt + tuple(seq.completion.token_ids),
                                   sampling.for_segment(remaining, seed), policy.adapter, seq.stream)
                self.table.acquire(policy)
                self._live[segment.engine_id] = segment
                try:
                    events = await self.engine.submit(spec)
                except BaseException:
                    self._end_segment(segment)
                    raise
            segment_no += 1
            finish: Finish | None = None
            try:
                async for event in events:
                    versions = [policy.version] * len(event.token_ids)
                    chunk = CompletionChunk(seq.index, event.token_ids, event.logprobs, versions, event.top_logprobs)
                    if event.finish is not None:
                        finish = event.finish
                        if not self._continues(segment, finish):
                            chunk.finish = finish
                    seq.completion.extend(chunk)
                    if chunk.token_ids or chunk.finish is not None:
                        seq.emit(chunk)
            finally:
                self._end_segment(segment)
            seq.completion.segments = segment_no
            if finish is not None and self._continues(segment, finish):
                continue
            if finish is None:
                self._finish(seq, Finish.ABORT)
            return

    @staticmethod
    def _continues(segment: _Segment, finish: Finish) -> bool:
        return finish is Finish.ABORT and segment.interrupted and not segment.sequence.cancelled

    @staticmethod
    def _finish(seq: _Sequence, finish: Finish) -> None:
        chunk = CompletionChunk(seq.index, [], [], [], finish=finish)
        seq.completion.extend(chunk)
        seq.emit(chunk)

    def _end_segment(self, segment: _Segment) -> None:
        if self._live.pop(segment.engine_id, None) is None:
            return
        drained = self.table.release(segment.policy)
        segment.ended.set()
        if drained is not None:
            self._spawn(self._unload_if_drained(drained))

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def decode(self, token_ids: list[int]) -> str:
        return self.renderer.decode(token_ids) if self.renderer is not None else ""

    # ============================================================== pause / resume / abort

    async def pause(self) -> None:
        self._client_paused = True
        await self.engine.pause()

    async def resume(self) -> None:
        self._client_paused = False
        if not self._gate.switching:
            await self.engine.resume()

    async def abort(self, request_ids: list[str]) -> int:
        """Ends these requests (all when empty) with Finish.ABORT; returns how many were found."""
        chosen = list(self._requests) if not request_ids else [r for r in request_ids if r in self._requests]
        victims: list[str] = []
        for request_id in chosen:
            for seq in self._requests[request_id]:
                seq.cancelled = True
            victims += [s.engine_id for s in self._live.values() if s.sequence.request.request_id == request_id]
        await self.engine.abort(victims)
        return len(chosen)

    # ============================================================================ policies

    def active_versions(self) -> dict[str, int]:
        return self.table.active_versions()

    def status(self) -> ReplicaStatus:
        stats = self.engine.stats()
        active = self.table.active_versions()
        policies = [LoadedPolicyStatus(v.job_id, v.version, v.mode, v.state, v.in_flight,
                                       active.get(v.job_id) == v.version) for v in self.table.all_versions()]
        return ReplicaStatus(policies=policies, paused=self._client_paused, in_flight=len(self._live),
                             queued=max(0, self._admitted - stats.running), peak_running=stats.peak_running)

    async def load(self, payload: PolicyPayload) -> None:
        """Stage and commit in one step (the LoadWeights RPC)."""
        await self.stage(payload)
        await self.commit(payload.job_id, payload.version)

    async def stage(self, payload: PolicyPayload) -> None:
        """Prepares a version without serving it; raises (changing nothing) if it cannot be served here."""
        async with self._policy_lock:
            if payload.fingerprint and payload.fingerprint != self.fingerprint:
                raise FailedPreconditionError(f"{payload.job_id} v{payload.version} was made for base model "
                                              f"{payload.fingerprint}, this replica serves {self.fingerprint}")
            self.table.check_stage(payload.job_id, payload.version, payload.serve_mode)
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
        self.table.add(LoadedVersion(payload.job_id, payload.version, Mode.ADAPTER, adapter=handle))

    async def _stage_merged(self, payload: PolicyPayload, previous: LoadedVersion | None) -> None:
        tensors = dict(payload.tensors)
        if payload.local_merge:
            if payload.lora is None:
                raise FailedPreconditionError("a local merge needs the adapter's LoRA spec")
            lora = check_adapter(tensors, payload.lora, self.files, NO_RANK_LIMIT)
            tensors = await asyncio.to_thread(merge_adapter, tensors, lora, self.files)
        check_merged(tensors, self.files)
        if previous is not None:
            await self._unload(previous)
        token = f"{payload.job_id}-v{payload.version}-{uuid.uuid4().hex[:8]}"
        await self.engine.stage_weights(token, complete_weights(tensors, self.files))
        self.table.add(LoadedVersion(payload.job_id, payload.version, Mode.MERGED, weights_token=token))

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
                    self._spawn(self._unload_if_drained(drained))
                if self.settings.update_policy == "continue":
                    await self._interrupt(lambda s: s.sequence.request.policy == PolicyRef(job_id, LATEST)
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

    async def _unload_if_drained(self, loaded: LoadedVersion) -> None:
        async with self._policy_lock:
            if self.table.get(loaded.job_id, loaded.version) is loaded and loaded.state is State.RETIRING \
                    and loaded.in_flight == 0:
                await self._unload(loaded)

    async def _interrupt(self, which: Callable[[_Segment], bool]) -> list[_Segment]:
        """Aborts matching segments so their sequences continue under the policy they resolve to now."""
        victims = [s for s in self._live.values() if which(s)]
        for segment in victims:
            segment.interrupted = True
        await self.engine.abort([s.engine_id for s in victims])
        return victims

    async def _switch_weights(self, token: str, label: str, on_loaded: Callable[[], object]) -> None:
        """Replaces the engine's weights between steps (see module docstring)."""
        async with self._gate.switch():
            await self.engine.pause()
            try:
                victims = await self._interrupt(lambda _s: True)
                if victims:
                    await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in victims)), DRAIN_TIMEOUT_S)
                await self.engine.load_weights(token, label)
                on_loaded()
                await self.engine.reset_prefix_cache()
            finally:
                if not self._client_paused:
                    await self.engine.resume()


def _ignore(_chunk: CompletionChunk) -> None:
    pass


async def _run_all(coros: list) -> None:
    """Runs coroutines concurrently; on the first failure (or cancellation) cancels the rest and re-raises."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
