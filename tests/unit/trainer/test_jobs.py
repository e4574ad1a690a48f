"""JobManager: where engine work runs, and warm-up on creation."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from pathlib import Path

import pytest

from lorarl.trainer.engines.api import TrainingSpec, TrajectoryRecord
from lorarl.trainer.service.jobs import JobManager


def priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class RecordingEngine:
    """Says on which thread, at which niceness, each piece of engine work ran."""

    version = step = 0
    vocab_size = 100

    def __init__(self, calls: list[tuple[str, int, int]], fail_warm_up: bool = False) -> None:
        self.calls, self.fail_warm_up = calls, fail_warm_up
        self.calls.append(("create", threading.get_native_id(), priority()))

    def memory(self) -> tuple[int, int, int]:
        return (0, 1, 0)

    def warm_up(self) -> None:
        self.calls.append(("warm_up", threading.get_native_id(), priority()))
        if self.fail_warm_up:
            raise RuntimeError("no warm-up today")

    def train_step(self, batch: list[TrajectoryRecord]) -> dict[str, float]:
        self.calls.append(("train_step", threading.get_native_id(), priority()))
        return {"loss": 0.0}

    def close(self) -> None:
        self.calls.append(("close", threading.get_native_id(), priority()))


def spec(path: Path) -> TrainingSpec:
    (path / "config.json").write_text("{}")
    return TrainingSpec(base_model_path=str(path))


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="niceness is a POSIX notion")
def test_engine_work_runs_on_threads_at_compute_nice_and_rpcs_keep_their_priority(tmp_path: Path) -> None:
    calls: list[tuple[str, int, int]] = []
    manager = JobManager(engine_factory=lambda s: RecordingEngine(calls), compute_nice=3)
    record = TrajectoryRecord([1, 2], [3], [-1.0], [0], 1.0, "g")

    async def scenario() -> tuple[int, int]:
        loop_thread = (threading.get_native_id(), priority())
        await manager.create("job", spec(tmp_path))
        manager.push("job", [record])
        await manager.train_step("job", 0, [])
        return loop_thread

    loop_tid, loop_priority = asyncio.run(scenario())
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert loop_priority == base  # the event loop (the gRPC handlers) is untouched
    assert [c[0] for c in calls] == ["create", "warm_up", "train_step"]
    assert all(tid != loop_tid and nice == min(base + 3, 19) for _, tid, nice in calls), calls


def test_each_jobs_engine_work_stays_on_one_thread_of_its_own(tmp_path: Path) -> None:
    """glibc keeps a thread's freed memory in that thread's arena: a job whose calls wandered over a pool held a
    step-sized high-water mark per thread. Calls overlapping on the loop still land on the job's one thread."""
    calls: dict[str, list[tuple[str, int, int]]] = {"a": [], "b": []}
    manager = JobManager(engine_factory=lambda s: RecordingEngine(calls[Path(s.base_model_path).name]))
    record = TrajectoryRecord([1, 2], [3], [-1.0], [0], 1.0, "g")
    for name in calls:
        (tmp_path / name).mkdir()

    async def scenario() -> None:
        for name in calls:
            await manager.create(name, spec(tmp_path / name))
        for _ in range(3):
            for name in calls:
                manager.push(name, [record])
            await asyncio.gather(*(manager.train_step(name, 0, []) for name in calls))
        await manager.delete("a")

    asyncio.run(scenario())
    threads = {name: {tid for _, tid, _ in made} for name, made in calls.items()}
    assert len(calls["a"]) == 6 and all(len(t) == 1 for t in threads.values()), calls
    assert threads["a"] != threads["b"]  # jobs on different bases still compute side by side
    assert list(manager._threads) == ["b"]  # a deleted job's thread goes with it


def test_a_failed_warm_up_still_creates_the_job(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[str, int, int]] = []
    manager = JobManager(engine_factory=lambda s: RecordingEngine(calls, fail_warm_up=True))
    job, _ = asyncio.run(manager.create("job", spec(tmp_path)))
    assert manager.get("job") is job and [c[0] for c in calls] == ["create", "warm_up"]
    assert "warm-up failed" in caplog.text


def test_a_created_job_is_kept_out_of_full_collections(tmp_path: Path) -> None:
    manager = JobManager(engine_factory=lambda s: RecordingEngine([]))
    try:
        job, _ = asyncio.run(manager.create("job", spec(tmp_path)))
        assert not any(o is job.engine.calls for o in gc.get_objects())  # frozen with the engine
    finally:
        gc.unfreeze()


def test_a_job_that_does_not_fit_is_refused_with_the_figures_and_leaves_the_others(dense_dir: Path) -> None:
    """RESOURCE_EXHAUSTED before loading a base that does not fit, and before training state that would not."""
    from lorarl.common.errors import ResourceExhaustedError
    from tests.unit.trainer.engine_utils import make_spec

    free = {"cpu": 10**12}
    manager = JobManager(free_bytes=lambda device: free[device])

    async def body() -> None:
        first, _ = await manager.create("first", make_spec(dense_dir, seed=1))
        base_bytes, _, adapter_bytes = first.engine.memory()
        free["cpu"] = base_bytes // 2  # a second base would not fit: refused before it loads
        with pytest.raises(ResourceExhaustedError, match=r"needs [\d.]+ GiB in bfloat16 on cpu, which has"):
            await manager.create("other-base", make_spec(dense_dir, seed=1, dtype="bfloat16"))
        assert len(manager.bases) == 1
        # On the resident base a job needs only its training state: 3 x its adapter beside it.
        free["cpu"] = 3 * adapter_bytes - 1
        with pytest.raises(ResourceExhaustedError, match="gradients and optimizer moments on cpu") as refused:
            await manager.create("second", make_spec(dense_dir, seed=2))
        assert "beside the 1 other job(s) on its base" in str(refused.value)
        assert [j.job_id for j in manager.list()] == ["first"] and len(first.engine.base.tenants) == 1
        free["cpu"] = 3 * adapter_bytes
        second, _ = await manager.create("second", make_spec(dense_dir, seed=2))
        assert second.engine.base is first.engine.base
        for job_id in ("first", "second"):
            await manager.delete(job_id)
        assert len(manager.bases) == 0

    asyncio.run(body())


def test_one_malloc_arena_from_the_second_job_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer's only job keeps glibc's per-thread arenas (the cap costs it step time); the second job
    caps them, once, before its engine is built."""
    import lorarl.trainer.service.jobs as jobs_module

    capped: list[int] = []
    monkeypatch.setattr(jobs_module, "limit_malloc_arenas", lambda: capped.append(1) or True)
    calls: list[tuple[str, int, int]] = []
    manager = JobManager(engine_factory=lambda s: RecordingEngine(calls))

    async def body() -> None:
        await manager.create("a", spec(tmp_path))
        assert capped == []
        await manager.create("b", spec(tmp_path))
        await manager.create("c", spec(tmp_path))
        assert capped == [1]

    try:
        asyncio.run(body())
    finally:
        gc.unfreeze()


class GatedEngine(RecordingEngine):
    """Its train_step waits for ``gate``: calls of its job stay in flight while the test looks."""

    def __init__(self, calls: list[tuple[str, int, int]], gate: threading.Event | None) -> None:
        super().__init__(calls)
        self.gate = gate

    def train_step(self, batch: list[TrajectoryRecord]) -> dict[str, float]:
        if self.gate is not None:
            assert self.gate.wait(30)
        return {"loss": 0.0, "tokens": float(sum(len(r.completion_token_ids) for r in batch))}


def test_a_job_past_its_tokens_in_flight_is_refused_and_the_others_are_not(tmp_path: Path) -> None:
    """trainer.max_job_tokens_in_flight: a job's calls hold their tokens while queued and running; one that
    would take the job past the quota is RESOURCE_EXHAUSTED, another job's call goes through, a call past the
    quota alone is INVALID_ARGUMENT (split it), and the room comes back as calls end."""
    from lorarl.common.errors import InvalidArgumentError, ResourceExhaustedError

    gate = threading.Event()
    manager = JobManager(engine_factory=lambda s: GatedEngine([], gate if s.base_model_path.endswith("a") else None),
                         max_job_tokens_in_flight=6)
    record = TrajectoryRecord([1, 2], [3], [-1.0], [0], 1.0, "g")  # 3 tokens
    for name in ("a", "b"):
        (tmp_path / name).mkdir()

    async def scenario() -> None:
        for name in ("a", "b"):
            await manager.create(name, spec(tmp_path / name))
        running = asyncio.ensure_future(manager.train_step("a", 0, [record]))
        queued = asyncio.ensure_future(manager.train_step("a", 0, [record]))
        await asyncio.sleep(0.05)
        assert manager.get("a").tokens_in_flight == 6
        with pytest.raises(ResourceExhaustedError, match=r"job 'a' has 6 tokens .* adds 3; each job may have 6"):
            await manager.train_step("a", 0, [record])
        with pytest.raises(ResourceExhaustedError, match="max_job_tokens_in_flight"):
            await manager.compute_logprobs("a", [record], reference=False)
        metrics, _, _ = await manager.train_step("b", 0, [record, record])  # b's room is its own
        assert metrics["tokens"] == 2
        with pytest.raises(InvalidArgumentError, match="split it"):
            await manager.train_step("b", 0, [record] * 3)
        gate.set()
        await asyncio.gather(running, queued)
        assert manager.get("a").tokens_in_flight == 0 == manager.get("b").tokens_in_flight
        await manager.train_step("a", 0, [record, record])

    asyncio.run(scenario())
