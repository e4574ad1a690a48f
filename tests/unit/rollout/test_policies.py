"""Policy bookkeeping: resolution, the adapter window, drained unloads, slots, merged exclusivity."""

from __future__ import annotations

import pytest

from lorarl.common.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError
from lorarl.rollout.policies import LoadedVersion, PolicyTable, State
from lorarl.rollout.schema import AdapterHandle, Mode, PolicyRef


def add_adapter(table: PolicyTable, job: str, version: int, commit: bool = True) -> LoadedVersion:
    table.check_stage(job, version, Mode.ADAPTER)
    for victim in table.make_room(job):
        table.remove(victim)
    loaded = LoadedVersion(job, version, Mode.ADAPTER,
                           adapter=AdapterHandle(f"{job}-v{version}", table.new_adapter_id(), rank=8))
    table.add(loaded)
    if commit:
        for drained in table.commit(job, version):
            table.remove(drained)
    return loaded


def test_latest_and_pinned_resolution() -> None:
    table = PolicyTable(window=3, capacity=4)
    add_adapter(table, "a", 1)
    add_adapter(table, "a", 2)
    assert table.resolve(PolicyRef("a")).version == 2
    assert table.resolve(PolicyRef("a", 1)).adapter.name == "a-v1"
    assert table.resolve(PolicyRef()).version == 0
    with pytest.raises(NotFoundError, match="servable versions: \\[1, 2\\]"):
        table.resolve(PolicyRef("a", 5))
    with pytest.raises(NotFoundError, match="jobs: \\['a'\\]"):
        table.resolve(PolicyRef("b"))
    with pytest.raises(NotFoundError, match="base model has no versions"):
        table.resolve(PolicyRef("", 3))


def test_staged_versions_are_not_servable_until_committed() -> None:
    table = PolicyTable(window=3, capacity=4)
    add_adapter(table, "a", 1)
    add_adapter(table, "a", 2, commit=False)
    assert table.resolve(PolicyRef("a")).version == 1
    with pytest.raises(NotFoundError, match="staged"):
        table.resolve(PolicyRef("a", 2))
    table.commit("a", 2)
    assert table.active_versions() == {"a": 2}


def test_commit_retires_beyond_the_window_and_release_reports_drained_versions() -> None:
    table = PolicyTable(window=2, capacity=4)
    v1 = add_adapter(table, "a", 1)
    table.acquire(v1.served)
    add_adapter(table, "a", 2)
    add_adapter(table, "a", 3, commit=False)
    drained = table.commit("a", 3)
    assert drained == [] and v1.state is State.RETIRING  # still in flight
    with pytest.raises(NotFoundError, match="retiring"):
        table.resolve(PolicyRef("a", 1))
    assert table.release(v1.served) is v1


def test_make_room_frees_idle_old_versions_and_refuses_when_all_are_busy() -> None:
    table = PolicyTable(window=3, capacity=3)
    v1 = add_adapter(table, "a", 1)
    add_adapter(table, "a", 2)
    add_adapter(table, "b", 1)
    assert table.make_room("a") == [v1]
    table.acquire(v1.served)
    held = r"a v1 \(1 in flight\), a v2 \(its job.s latest\), b v1 \(its job.s latest\); unload a job"
    with pytest.raises(ResourceExhaustedError, match=held):
        table.make_room("a")


def test_another_jobs_idle_old_versions_give_way_but_never_its_latest_or_one_in_flight() -> None:
    """A job arriving at a full engine (a Tinker user's first save, a restored sampler path) takes the slot of
    another job's idle older version, from the job holding most; latest versions and requests stay."""
    table = PolicyTable(window=4, capacity=4)
    a1, a2 = add_adapter(table, "a", 1), add_adapter(table, "a", 2)
    add_adapter(table, "a", 3)
    add_adapter(table, "b", 1)
    table.acquire(a1.served)
    assert table.make_room("c") == [a2]  # a v1 is in flight: a v2 is the oldest idle one
    table.remove(a2)
    add_adapter(table, "c", 1)
    with pytest.raises(ResourceExhaustedError, match=r"each a job's latest version or in flight"):
        table.make_room("d")  # a v1 in flight; a v3, b v1, c v1 latest
    assert table.resolve(PolicyRef("a")).version == 3 and table.resolve(PolicyRef("b")).version == 1


def test_merged_job_owns_the_weights() -> None:
    table = PolicyTable(window=3, capacity=4)
    add_adapter(table, "a", 1)
    table.check_stage("m", 1, Mode.MERGED)
    table.add(LoadedVersion("m", 1, Mode.MERGED, weights_token="t1"))
    table.commit("m", 1)
    with pytest.raises(FailedPreconditionError, match="merged m v1"):
        table.resolve(PolicyRef())
    with pytest.raises(FailedPreconditionError, match="merged m v1"):
        table.resolve(PolicyRef("a"))
    with pytest.raises(FailedPreconditionError, match="another merged job"):
        table.check_stage("n", 1, Mode.MERGED)
    with pytest.raises(FailedPreconditionError, match="served as merged"):
        table.check_stage("m", 2, Mode.ADAPTER)
    table.add(LoadedVersion("m", 2, Mode.MERGED, weights_token="t2"))
    table.commit("m", 2)
    assert [v.version for v in table.all_versions() if v.job_id == "m"] == [2]
    assert table.resolve(PolicyRef("m")).version == 2


def test_retire_job_splits_idle_and_busy_versions() -> None:
    table = PolicyTable(window=3, capacity=4)
    v1 = add_adapter(table, "a", 1)
    v2 = add_adapter(table, "a", 2)
    table.acquire(v2.served)
    idle, busy = table.retire_job("a")
    assert idle == [v1] and busy == [v2]
    with pytest.raises(NotFoundError):
        table.retire_job("zzz")
