"""Two-phase activation as a plain class: commit only when all staged and durable, abort the rest on failure."""

from __future__ import annotations

from lorarl.v1 import weightsync_pb2
from lorarl.weightsync.service.replicas import ReplicaDirectory
from lorarl.weightsync.service.rounds import ACTIVE, FAILED, PENDING, ActivationCoordinator, Member, Phase, Round


class Outbox(list):
    def put_nowait(self, item) -> None:
        self.append(item)


class Harness:
    def __init__(self, *replicas: str, grace: float = 2.0, timeout: float = 10.0) -> None:
        self.directory = ReplicaDirectory(outbox_factory=Outbox)
        for rid in replicas:
            self.directory.connect(weightsync_pb2.SubscribeRequest(replica_id=rid))
        self.commits: list[tuple[str, int]] = []
        self.done: list[Round] = []
        self.coordinator = ActivationCoordinator(
            self.directory, stage_timeout_s=timeout, disconnect_grace_s=grace,
            on_commit=lambda job, v: self.commits.append((job, v)), on_done=self.done.append)

    def round(self, version: int, members: dict[str, str], durable: bool = True, catch_up: bool = False) -> Round:
        made = {rid: Member(rid, weightsync_pb2.StageEvent(manifest={"job_id": "j", "version": version}), transport)
                for rid, transport in members.items()}
        return Round("j", version, made, durable=durable, catch_up=catch_up)

    def events(self, rid: str) -> list[str]:
        """'kind:version' of every event sent to `rid`."""
        out = []
        for event in self.directory.replicas[rid].outbox:
            kind = event.WhichOneof("event")
            body = getattr(event, kind)
            out.append(f"{kind}:{body.manifest.version if kind == 'stage' else body.version}")
        return out


def test_commit_after_every_member_staged_then_active() -> None:
    h = Harness("a", "b")
    r = h.round(1, {"a": "collective", "b": "collective"})
    h.coordinator.submit(r, now=0)
    assert h.events("a") == ["stage:1"] and h.events("b") == ["stage:1"]
    h.coordinator.staged("a", "j", 1, True, "", now=1)
    assert h.commits == [] and r.phase is Phase.STAGING
    h.coordinator.staged("b", "j", 1, True, "", now=1)
    assert h.commits == [("j", 1)] and h.events("a")[-1] == "commit:1"
    assert r.outcome == PENDING
    h.coordinator.activated("a", "j", 1, now=2)
    h.coordinator.activated("b", "j", 1, now=2)
    assert r.outcome == ACTIVE and h.done == [r]
    assert h.directory.state("a", "j").active_version == 1


def test_one_failure_aborts_the_others_and_names_the_failing_replica() -> None:
    h = Harness("a", "b", "c")
    r = h.round(2, {"a": "collective", "b": "collective", "c": "collective"})
    h.coordinator.submit(r, now=0)
    h.coordinator.staged("a", "j", 2, True, "", now=1)
    h.coordinator.staged("b", "j", 2, False, "PayloadError: bucket 0: checksum mismatch", now=1)
    assert r.outcome == PENDING  # c is still receiving: wait briefly in case c is the real culprit
    h.coordinator.staged("c", "j", 2, True, "", now=1.2)
    assert r.outcome == FAILED and r.failed == ["b"] and "b: PayloadError" in r.error
    assert h.commits == []
    assert h.events("a") == ["stage:2", "abort:2"] and h.events("c") == ["stage:2", "abort:2"]
    assert h.events("b") == ["stage:2"]
    assert "checksum mismatch" in h.directory.state("b", "j").last_error
    assert h.directory.state("a", "j").last_error == "" and h.directory.state("a", "j").staged_version == 0
    # A late report of the finished round changes nothing.
    assert not h.coordinator.staged("c", "j", 2, True, "", now=2)


def test_a_failure_with_silent_peers_is_settled_after_the_attribution_window() -> None:
    h = Harness("a", "b")
    r = h.round(1, {"a": "collective", "b": "collective"})
    h.coordinator.submit(r, now=0)
    h.coordinator.staged("a", "j", 1, False, "RuntimeError: timed out", now=1)
    h.coordinator.tick(now=1.5)
    assert r.outcome == PENDING
    h.coordinator.tick(now=2.0)
    assert r.outcome == FAILED and r.failed == ["a"]


def test_a_peer_that_dropped_out_is_blamed_not_the_replicas_it_broke() -> None:
    h = Harness("survivor", "doomed")
    r = h.round(2, {"survivor": "collective", "doomed": "collective"})
    h.coordinator.submit(r, now=0)
    h.coordinator.staged("survivor", "j", 2, False, "RuntimeError: Connection closed by peer", now=1)
    h.coordinator.disconnected("doomed", now=1.1)  # noticed just after the survivor's report
    assert r.outcome == FAILED and r.failed == ["doomed"]
    assert "dropped its subscription" in r.error and "as a consequence: survivor: RuntimeError" in r.error
    assert h.directory.state("survivor", "j").last_error == ""
    assert "dropped its subscription" in h.directory.state("doomed", "j").last_error
    reports = {m.replica_id: m.error for m in r.result().replicas}
    assert reports["survivor"].startswith("collateral of doomed: RuntimeError")


def test_inline_failures_fail_at_once() -> None:
    h = Harness("a", "b")
    r = h.round(1, {"a": "inline", "b": "collective"})
    h.coordinator.submit(r, now=0)
    h.coordinator.staged("a", "j", 1, False, "PayloadError: short transfer", now=1)
    assert r.outcome == FAILED and r.failed == ["a"] and h.events("b")[-1] == "abort:1"


def test_inline_members_wait_for_the_durable_copy_and_commit_needs_it() -> None:
    h = Harness("a", "b")
    r = h.round(1, {"a": "collective", "b": "inline"}, durable=False)
    h.coordinator.submit(r, now=0)
    assert h.events("a") == ["stage:1"] and h.events("b") == []
    h.coordinator.staged("a", "j", 1, True, "", now=1)
    h.coordinator.set_durable("j", 1, now=1)
    assert h.events("b") == ["stage:1"] and h.commits == []
    h.coordinator.staged("b", "j", 1, True, "", now=2)
    assert h.commits == [("j", 1)]


def test_round_without_replicas_commits_once_durable() -> None:
    h = Harness()
    r = h.round(1, {}, durable=False)
    h.coordinator.submit(r, now=0)
    assert r.outcome == PENDING
    h.coordinator.set_durable("j", 1, now=0.5)
    assert r.outcome == ACTIVE and h.commits == [("j", 1)]


def test_dropped_stream_fails_the_round_after_the_grace_period() -> None:
    h = Harness("a", "b", grace=2.0)
    r = h.round(1, {"a": "collective", "b": "collective"})
    h.coordinator.submit(r, now=0)
    h.directory.disconnect("b", h.directory.replicas["b"].session)
    h.coordinator.disconnected("b", now=1)
    h.coordinator.tick(now=2.5)
    assert r.outcome == PENDING
    h.coordinator.tick(now=3.0)
    assert r.outcome == FAILED and r.failed == ["b"] and "dropped its subscription" in r.error
    assert h.events("a")[-1] == "abort:1"


def test_a_silent_member_fails_at_the_deadline_and_so_does_a_missing_upload() -> None:
    h = Harness("a", timeout=10)
    r = h.round(1, {"a": "collective"})
    h.coordinator.submit(r, now=0)
    h.coordinator.tick(now=9.9)
    assert r.outcome == PENDING
    h.coordinator.tick(now=10)
    assert r.outcome == FAILED and "did not stage v1 within 10 s" in r.error

    r2 = h.round(2, {"a": "collective"}, durable=False)
    h.coordinator.submit(r2, now=20)
    h.coordinator.staged("a", "j", 2, True, "", now=21)
    h.coordinator.tick(now=30)
    assert r2.outcome == FAILED and r2.failed == ["trainer"] and "not uploaded" in r2.error


def test_publish_rounds_of_a_job_run_one_at_a_time() -> None:
    h = Harness("a")
    r1, r2 = h.round(1, {"a": "collective"}), h.round(2, {"a": "collective"})
    h.coordinator.submit(r1, now=0)
    h.coordinator.staged("a", "j", 1, True, "", now=1)  # committing: v1 goes live before v2 starts
    h.coordinator.submit(r2, now=1)
    assert h.events("a") == ["stage:1", "commit:1"] and r2.phase is Phase.QUEUED
    assert h.coordinator.busy("a", "j")
    h.coordinator.activated("a", "j", 1, now=1)
    assert h.events("a") == ["stage:1", "commit:1", "stage:2"] and r2.phase is Phase.STAGING
    h.coordinator.staged("a", "j", 2, True, "", now=2)
    h.coordinator.activated("a", "j", 2, now=2)
    assert h.commits == [("j", 1), ("j", 2)]


def test_a_newer_publish_supersedes_rounds_still_staging_or_queued() -> None:
    """A trainer publishes only once its last version settled, so a newer version while an older one
    stages means the older one's publisher is gone (#29): its members are told to abort and stage anew."""
    h = Harness("a", "b")
    r1 = h.round(1, {"a": "collective", "b": "collective"})
    h.coordinator.submit(r1, now=0)
    h.coordinator.staged("a", "j", 1, True, "", now=1)  # b never reports: stuck joining a dead sender's group
    r3 = h.round(3, {"a": "collective", "b": "collective"})
    h.coordinator.submit(r3, now=2)
    assert r1.outcome == FAILED and "superseded by v3" in r1.error and r1.failed == []
    assert h.events("a") == ["stage:1", "abort:1", "stage:3"] and h.events("b") == ["stage:1", "abort:1", "stage:3"]
    assert r3.phase is Phase.STAGING and h.coordinator.find("j", 1) is None
    assert h.coordinator.staged("b", "j", 1, False, "store timeout", now=3) is False  # a stale report: ignored
    for rid in ("a", "b"):
        h.coordinator.staged(rid, "j", 3, True, "", now=4)
    for rid in ("a", "b"):
        h.coordinator.activated(rid, "j", 3, now=4)
    assert r3.outcome == ACTIVE and h.commits == [("j", 3)]


def test_catch_up_rounds_do_not_commit_the_job_again_and_run_beside_publishes() -> None:
    h = Harness("a", "late")
    h.coordinator.submit(h.round(5, {"a": "collective"}), now=0)
    catch_up = h.round(4, {"late": "inline"}, catch_up=True)
    h.coordinator.submit(catch_up, now=0)
    assert h.events("late") == ["stage:4"]
    h.coordinator.staged("late", "j", 4, True, "", now=1)
    h.coordinator.activated("late", "j", 4, now=1)
    assert catch_up.outcome == ACTIVE and h.commits == []


def test_member_that_vanishes_before_activating_is_reported_not_waited_for() -> None:
    h = Harness("a", "b", timeout=5)
    r = h.round(1, {"a": "collective", "b": "collective"})
    h.coordinator.submit(r, now=0)
    h.coordinator.staged("a", "j", 1, True, "", now=1)
    h.coordinator.staged("b", "j", 1, True, "", now=1)
    h.coordinator.activated("a", "j", 1, now=1)
    h.coordinator.disconnected("b", now=2)
    assert r.outcome == ACTIVE
    assert {m.replica_id: (m.active, m.error) for m in r.members.values()} == {
        "a": (True, ""), "b": (False, "stream dropped before it reported active")}
