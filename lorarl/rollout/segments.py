"""The segment runner: a replica's completions, each decoded as one or more engine segments.

Each segment is decoded under one fixed policy, so every token is tagged with the version that
produced it. When a weight switch interrupts a segment (lorarl.rollout.policy_manager), the
completion is resubmitted as prompt + tokens so far under the policy it resolves to now, and the
tags change mid-sequence. A request pinned to a version no longer loaded ends with Finish.ABORT.

Kept apart from the policy manager: this side only reads the policy table (resolve, acquire,
release) and never loads or unloads a version; it tells the manager when a retiring version has
drained (``on_drained``), and the manager asks it to interrupt segments (``interrupt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from lorarl.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    ServiceError,
)
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.engine_api import GenerationEngine
from lorarl.rollout.gate import SwitchGate
from lorarl.rollout.policies import LoadedVersion, PolicyTable
from lorarl.rollout.prompts import PromptRenderer
from lorarl.rollout.schema import (
    Completion,
    CompletionChunk,
    Finish,
    GenerateInput,
    PromptResult,
    SegmentSpec,
    ServedPolicy,
)

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    """One completion (prompt x one of n) across its segments."""

    key: str
    index: int
    prompt: tuple[int, ...]
    request: GenerateInput
    emit: Callable[[CompletionChunk], None]
    stream: bool
    completion: Completion = field(default_factory=Completion)
    cancelled: bool = False
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class Segment:
    engine_id: str
    sequence: Sequence
    policy: ServedPolicy
    interrupted: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class SegmentRunner:
    """Generation of one replica on top of any GenerationEngine, with exact per-token versions."""

    def __init__(self, engine: GenerationEngine, settings: RolloutSettings, table: PolicyTable, gate: SwitchGate,
                 renderer: PromptRenderer | None, on_drained: Callable[[LoadedVersion], Awaitable[None]]) -> None:
        self.engine = engine
        self.settings = settings
        self.table = table
        self.renderer = renderer
        self._gate = gate
        self._on_drained = on_drained
        self._live: dict[str, Segment] = {}
        self._requests: dict[str, list[Sequence]] = {}
        self._admitted = 0
        self._job_tokens: dict[str, int] = {}  # tokens admitted per job (rollout.max_job_tokens_in_flight)
        self.client_paused = False
        self._background: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        """Segments the engine is decoding now."""
        return len(self._live)

    @property
    def admitted(self) -> int:
        """Sequences admitted and not yet finished (running or queued)."""
        return self._admitted

    def close(self) -> None:
        for task in list(self._background):
            task.cancel()

    @contextlib.contextmanager
    def _admit(self, request: GenerateInput, count: int) -> Iterator[None]:
        limit = self.settings.max_queued_requests
        if count > limit:  # never fits, however long the caller waits: a request to split, not to retry
            raise InvalidArgumentError("prompts", f"this request adds {count} sequences (prompts x n); this replica "
                                       f"admits at most {limit} at once (rollout.max_queued_requests): split it")
        if self._admitted + count > limit:
            raise ResourceExhaustedError(f"{self._admitted} sequences in flight and this request adds {count}; "
                                         f"the limit is {limit} (rollout.max_queued_requests): retry later")
        job, tokens = request.policy.job_id, request_tokens(request)
        quota = self.settings.max_job_tokens_in_flight
        if quota:
            held = self._job_tokens.get(job, 0)
            whose = f"job {job!r}" if job else "the base model"
            if tokens > quota:
                raise InvalidArgumentError("prompts", f"this request holds {tokens} tokens (prompt + max_tokens, x n); "
                                           f"{whose} may hold at most {quota} at once on this replica "
                                           "(rollout.max_job_tokens_in_flight): split it")
            if held + tokens > quota:
                raise ResourceExhaustedError(
                    f"{whose} has {held} tokens in flight (prompt + max_tokens, x n) and this request adds {tokens}; "
                    f"each job may hold {quota} (rollout.max_job_tokens_in_flight), so that the other jobs on this "
                    "replica keep their room: retry later")
        if request.request_id in self._requests:
            raise AlreadyExistsError(f"request {request.request_id!r} is already in flight")
        self._admitted += count
        self._job_tokens[job] = self._job_tokens.get(job, 0) + tokens
        try:
            yield
        finally:
            self._admitted -= count
            self._job_tokens[job] -= tokens
            if not self._job_tokens[job]:
                del self._job_tokens[job]
            self._requests.pop(request.request_id, None)

    def job_tokens(self, job_id: str) -> int:
        """Tokens the job's admitted requests hold (prompt + max_tokens per sequence)."""
        return self._job_tokens.get(job_id, 0)

    def _sequences(self, request: GenerateInput, emit: Callable[[CompletionChunk], None] | None,
                   prompt_index: int, prompt: tuple[int, ...]) -> list[Sequence]:
        """One Sequence per completion; without `emit` (unary calls) tokens only need to arrive at the end."""
        return [Sequence(key=f"{request.request_id}/{prompt_index}.{i}", index=i, prompt=prompt, request=request,
                          emit=emit or _ignore, stream=emit is not None) for i in range(request.sampling.n)]

    async def generate(self, request: GenerateInput) -> list[PromptResult]:
        """All completions of all prompts; they run concurrently, so the engine batches them."""
        self.table.resolve(request.policy)  # NOT_FOUND / FAILED_PRECONDITION before any work
        if request.sampling.prompt_logprobs and not getattr(self.engine, "serves_prompt_logprobs", False):
            raise FailedPreconditionError(f"sampling.prompt_logprobs: the {type(self.engine).__name__} engine does "
                                          "not compute them (the vLLM engine does)")
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
            results.append(PromptResult(list(prompt), [s.completion for s in group], group[0].prompt_logprobs,
                                        group[0].prompt_top_logprobs))
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

    async def _run_sequence(self, seq: Sequence) -> None:
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
                segment = Segment(f"{seq.key}/{segment_no}", seq, policy)
                wants_prompt = sampling.prompt_logprobs and seq.index == 0 and segment_no == 0
                spec = SegmentSpec(segment.engine_id, seq.prompt + tuple(seq.completion.token_ids),
                                   sampling.for_segment(remaining, seed, wants_prompt), policy.adapter, seq.stream)
                self.table.acquire(policy)
                self._live[segment.engine_id] = segment
                try:
                    events = await self.engine.submit(spec)
                except BaseException:
                    self._end_segment(segment)
                    raise
            segment_no += 1
            if policy.weights:
                seq.completion.fingerprints[policy.version] = policy.weights
            finish: Finish | None = None
            try:
                async for event in events:
                    if event.prompt_logprobs is not None:
                        seq.prompt_logprobs = event.prompt_logprobs
                        seq.prompt_top_logprobs = event.prompt_top_logprobs
                    if event.routes is not None:
                        seq.completion.add_routes(event.routes)
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
    def _continues(segment: Segment, finish: Finish) -> bool:
        return finish is Finish.ABORT and segment.interrupted and not segment.sequence.cancelled

    @staticmethod
    def _finish(seq: Sequence, finish: Finish) -> None:
        chunk = CompletionChunk(seq.index, [], [], [], finish=finish)
        seq.completion.extend(chunk)
        seq.emit(chunk)

    def _end_segment(self, segment: Segment) -> None:
        if self._live.pop(segment.engine_id, None) is None:
            return
        drained = self.table.release(segment.policy)
        segment.ended.set()
        if drained is not None:
            self.spawn(self._on_drained(drained))

    def spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def decode(self, token_ids: list[int]) -> str:
        return self.renderer.decode(token_ids) if self.renderer is not None else ""

    async def pause(self) -> None:
        self.client_paused = True
        await self.engine.pause()

    async def resume(self) -> None:
        self.client_paused = False
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

    async def interrupt(self, which: Callable[[Segment], bool]) -> list[Segment]:
        """Aborts matching segments so their sequences continue under the policy they resolve to now."""
        victims = [s for s in self._live.values() if which(s)]
        for segment in victims:
            segment.interrupted = True
        await self.engine.abort([s.engine_id for s in victims])
        return victims


def request_tokens(request: GenerateInput) -> int:
    """What a request may hold at most: each sequence's prompt and its max_tokens, n sequences per prompt."""
    return sum(len(prompt) + request.sampling.max_tokens for prompt in request.prompts) * request.sampling.n


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
