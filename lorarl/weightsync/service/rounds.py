"""Two-phase activation of a version across replicas: stage everywhere, then commit everywhere.

A round is the set of replicas told to stage one version. Phase 1: each member receives and
verifies the bytes and reports staged (ok or not). If any member fails, times out, or drops its
stream and stays silent for the grace period, the round FAILS: the others get an Abort and keep
serving their previous version. A collective transfer breaks for every member when one dies, so
blame is attributed: a member whose stream dropped is the cause, and the transport errors its
peers report meanwhile are collateral (kept in their activation entry, not in failed_replicas).
When every member staged and the adapter is durable on disk, the version becomes the job's active
version and phase 2 sends Commit; members report active.

Publish rounds of one job run one at a time (the next waits in a queue, its membership fixed at
publish time because the trainer's collective group was sized then). Catch-up rounds bring one
late or restarted replica to the active version and run beside them. The coordinator is plain and
synchronous: time comes from the caller, events leave through the ReplicaDirectory.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lorarl.v1 import weightsync_pb2
from lorarl.weightsync.service.replicas import ReplicaDirectory
from lorarl.weightsync.service.results import ActivationResult, ReplicaOutcome

logger = logging.getLogger(__name__)

PENDING = weightsync_pb2.ACTIVATION_OUTCOME_PENDING
ACTIVE = weightsync_pb2.ACTIVATION_OUTCOME_ACTIVE
FAILED = weightsync_pb2.ACTIVATION_OUTCOME_FAILED


class Phase(enum.Enum):
    QUEUED = "queued"
    STAGING = "staging"
    COMMITTING = "committing"
    DONE = "done"


@dataclass
class Member:
    """One replica's part in a round; `stage` is the event it is sent (manifest, rank, serve mode)."""

    replica_id: str
    stage: weightsync_pb2.StageEvent
    transport: str  # "collective" | "inline" | "shared_memory"
    stage_sent: bool = False
    staged: bool = False
    active: bool = False
    error: str = ""
    lost_at: float | None = None
    failed_at: float | None = None

    def report(self) -> ReplicaOutcome:
        return ReplicaOutcome(self.replica_id, self.staged, self.active, self.error, self.transport)


@dataclass
class Round:
    job_id: str
    version: int
    members: dict[str, Member]
    durable: bool
    catch_up: bool = False
    phase: Phase = Phase.QUEUED
    outcome: int = PENDING
    error: str = ""
    failed: list[str] = field(default_factory=list)
    deadline: float = 0.0

    def result(self) -> ActivationResult:
        return ActivationResult(self.job_id, self.version, self.outcome, self.error, list(self.failed),
                                [m.report() for _, m in sorted(self.members.items())])


class ActivationCoordinator:
    """Runs rounds (see module docstring). Callbacks: on_commit(job, version) before Commit is sent
    (must make the version active durably), on_done(round) once a round is resolved."""

    def __init__(self, directory: ReplicaDirectory, *, stage_timeout_s: float, disconnect_grace_s: float,
                 on_commit: Callable[[str, int], None], on_done: Callable[[Round], None],
                 attribution_s: float = 1.0) -> None:
        """attribution_s: how long a collective failure waits for a silent peer to show it dropped out."""
        self.directory = directory
        self.stage_timeout_s, self.disconnect_grace_s = stage_timeout_s, disconnect_grace_s
        self.attribution_s = min(attribution_s, disconnect_grace_s)
        self.on_commit, self.on_done = on_commit, on_done
        self.running: list[Round] = []
        self.queued: dict[str, deque[Round]] = {}

    # ------------------------------------------------------------------------------- queries

    def busy(self, replica_id: str, job_id: str) -> bool:
        """Whether the replica is in an unresolved round of `job_id` (running or queued)."""
        rounds = [*self.running, *self.queued.get(job_id, ())]
        return any(r.job_id == job_id and replica_id in r.members for r in rounds)

    def find(self, job_id: str, version: int, replica_id: str | None = None) -> Round | None:
        for r in self.running:
            if r.job_id == job_id and r.version == version and (replica_id is None or replica_id in r.members):
                return r
        return None

    # ------------------------------------------------------------------------------- inputs

    def submit(self, round_: Round, now: float) -> None:
        """Starts a round, or queues a publish round behind the job's running one. A publish round
        supersedes the job's older ones that have not reached commit (see `_supersede`)."""
        if not round_.catch_up:
            self._supersede(round_, now)
        publishing = any(r.job_id == round_.job_id and not r.catch_up for r in self.running)
        if not round_.catch_up and (publishing or self.queued.get(round_.job_id)):
            self.queued.setdefault(round_.job_id, deque()).append(round_)
            return
        self._start(round_, now)

    def set_durable(self, job_id: str, version: int, now: float) -> None:
        """The version's adapter is on disk: inline members can fetch it, and commit may proceed."""
        for r in [*self.running, *self.queued.get(job_id, ())]:
            if r.job_id == job_id and r.version == version:
                r.durable = True
                if r.phase is Phase.STAGING:
                    self._send_stages(r, now)
                    self._maybe_commit(r, now)

    def staged(self, replica_id: str, job_id: str, version: int, ok: bool, error: str, now: float) -> bool:
        """A member's staging result; False when no running round expects it (stale report)."""
        r = self.find(job_id, version, replica_id)
        if r is None or r.phase is not Phase.STAGING:
            if not ok and replica_id in self.directory.replicas:
                self.directory.state(replica_id, job_id).last_error = f"v{version}: {error}"
            return False
        member = r.members[replica_id]
        if not ok:
            member.error, member.failed_at = error or "staging failed", now
            self._settle_failures(r, now, waited=member.transport == "inline")
            return True
        member.staged, member.lost_at = True, None
        self.directory.state(replica_id, job_id).staged_version = version
        self._settle_failures(r, now)
        self._maybe_commit(r, now)
        return True

    def activated(self, replica_id: str, job_id: str, version: int, now: float) -> None:
        if replica_id in self.directory.replicas:
            state = self.directory.state(replica_id, job_id)
            state.active_version = max(state.active_version, version)
            if state.staged_version <= version:
                state.staged_version = 0
            state.last_error = ""
        r = self.find(job_id, version, replica_id)
        if r is not None and r.phase is Phase.COMMITTING:
            r.members[replica_id].active = True
            self._maybe_done(r, now)

    def disconnected(self, replica_id: str, now: float) -> None:
        for r in list(self.running):
            member = r.members.get(replica_id)
            if member is None:
                continue
            if r.phase is Phase.STAGING and not member.staged and member.lost_at is None:
                member.lost_at = now
                self._settle_failures(r, now)
            elif r.phase is Phase.COMMITTING and not member.active:
                member.error = "stream dropped before it reported active"
                self._maybe_done(r, now)

    def tick(self, now: float) -> None:
        """Applies the disconnect grace and the round deadlines."""
        for r in list(self.running):
            if r.phase is Phase.STAGING:
                self._settle_failures(r, now)
            if r.phase is Phase.STAGING:
                lost = {rid: f"replica {rid} dropped its subscription while staging v{r.version} "
                             f"(silent for {self.disconnect_grace_s:g} s)"
                        for rid, m in r.members.items()
                        if m.lost_at is not None and now - m.lost_at >= self.disconnect_grace_s}
                if lost:
                    self._fail(r, lost, now)
                elif now >= r.deadline:
                    late = {rid: f"did not stage v{r.version} within {self.stage_timeout_s:g} s"
                            for rid, m in r.members.items() if not m.staged}
                    if not r.durable:
                        late["trainer"] = (f"the adapter of v{r.version} was not uploaded "
                                           f"within {self.stage_timeout_s:g} s")
                    self._fail(r, late, now)
            elif r.phase is Phase.COMMITTING and now >= r.deadline:
                for m in r.members.values():
                    if not m.active and not m.error:
                        m.error = f"did not report active within {self.stage_timeout_s:g} s"
                self._finish(r, ACTIVE, now)

    # ------------------------------------------------------------------------------- internals

    def _supersede(self, newer: Round, now: float) -> None:
        """Fails the job's older publish rounds still queued or staging: a trainer publishes a version only
        once the previous one has settled (lorarl.client.rl.loop), so a newer one arriving first means the
        older one's publisher is gone (a trainer restarted mid-publish, its sender never to come) and its
        members may be stuck joining a group nobody sends to. They get an Abort and stage the newer one."""
        queue = self.queued.get(newer.job_id, deque())
        for old in [r for r in queue if r.version < newer.version]:
            queue.remove(old)
            old.phase, old.outcome = Phase.DONE, FAILED
            old.error = f"superseded by v{newer.version} before it started"
            self.on_done(old)
        for old in [r for r in self.running if r.job_id == newer.job_id and not r.catch_up
                    and r.phase is Phase.STAGING and r.version < newer.version]:
            reason = f"superseded by v{newer.version}, published while v{old.version} was still staging"
            old.error = reason
            for rid, m in old.members.items():
                m.error = "superseded"
                self._abort_member(old, rid, reason)
            logger.warning("round %s v%d failed: %s", old.job_id, old.version, reason,
                           extra={"job_id": old.job_id, "version": old.version})
            old.phase, old.outcome = Phase.DONE, FAILED
            self.running.remove(old)
            self.on_done(old)

    def _start(self, r: Round, now: float) -> None:
        r.phase, r.deadline = Phase.STAGING, now + self.stage_timeout_s
        self.running.append(r)
        logger.info("round %s v%d started: %s", r.job_id, r.version,
                    ", ".join(f"{m.replica_id}({_where(m)})" for m in r.members.values()) or "no replicas",
                    extra={"job_id": r.job_id, "version": r.version, "catch_up": r.catch_up})
        self._send_stages(r, now)
        self._maybe_commit(r, now)

    def _send_stages(self, r: Round, now: float) -> None:
        for m in r.members.values():
            if m.stage_sent or (m.transport == "inline" and not r.durable):
                continue  # inline members fetch from the durable copy, so they wait for the upload
            m.stage_sent = True
            sent = self.directory.send(m.replica_id, weightsync_pb2.SubscribeResponse(stage=m.stage))
            if not sent and m.lost_at is None:
                m.lost_at = now

    def _settle_failures(self, r: Round, now: float, waited: bool = False) -> None:
        """Fails the round once its failure reports can be attributed (see module docstring)."""
        reported = {rid: m for rid, m in r.members.items() if m.failed_at is not None}
        if not reported or r.phase is not Phase.STAGING:
            return
        lost = {rid: f"replica {rid} dropped its subscription while staging v{r.version}"
                for rid, m in r.members.items() if m.lost_at is not None and m.failed_at is None and not m.staged}
        if lost:
            self._fail(r, lost, now, collateral=reported)
            return
        silent = [m for m in r.members.values() if m.failed_at is None and not m.staged]
        first = min(m.failed_at for m in reported.values() if m.failed_at is not None)
        if waited or not silent or now - first >= self.attribution_s:
            self._fail(r, {rid: m.error for rid, m in reported.items()}, now)

    def _maybe_commit(self, r: Round, now: float) -> None:
        if r.phase is not Phase.STAGING or not r.durable or not all(m.staged for m in r.members.values()):
            return
        if not r.catch_up:
            self.on_commit(r.job_id, r.version)
        r.phase, r.deadline = Phase.COMMITTING, now + self.stage_timeout_s
        for m in r.members.values():
            event = weightsync_pb2.SubscribeResponse(commit=weightsync_pb2.CommitEvent(job_id=r.job_id,
                                                                                        version=r.version))
            if not self.directory.send(m.replica_id, event):
                m.error = "disconnected before commit"
        self._maybe_done(r, now)

    def _maybe_done(self, r: Round, now: float) -> None:
        if all(m.active or m.error for m in r.members.values()):
            self._finish(r, ACTIVE, now)

    def _fail(self, r: Round, failures: dict[str, str], now: float,
              collateral: dict[str, Member] | None = None) -> None:
        collateral = collateral or {}
        r.failed = sorted(failures)
        r.error = "; ".join(f"{rid}: {why}" for rid, why in sorted(failures.items()))
        if collateral:
            r.error += "; then, as a consequence: " + "; ".join(f"{rid}: {m.error}"
                                                                 for rid, m in sorted(collateral.items()))
        reason = f"v{r.version} aborted: staging failed on {', '.join(r.failed)}"
        for rid, m in r.members.items():
            if rid in failures:
                m.error = failures[rid]
                self.directory.state(rid, r.job_id).last_error = f"v{r.version}: {failures[rid]}"
            elif rid in collateral:
                m.error = f"collateral of {', '.join(r.failed)}: {m.error}"
            else:
                m.error = "aborted"
                self._abort_member(r, rid, reason)
                continue
            self._forget_staged(r, rid)
        logger.warning("round %s v%d failed: %s", r.job_id, r.version, r.error,
                       extra={"job_id": r.job_id, "version": r.version, "failed": r.failed})
        self._finish(r, FAILED, now)

    def _abort_member(self, r: Round, replica_id: str, reason: str) -> None:
        """Tells a member to drop the round's version, and forgets it was staged there."""
        self.directory.send(replica_id, weightsync_pb2.SubscribeResponse(
            abort=weightsync_pb2.AbortEvent(job_id=r.job_id, version=r.version, reason=reason)))
        self._forget_staged(r, replica_id)

    def _forget_staged(self, r: Round, replica_id: str) -> None:
        state = self.directory.state(replica_id, r.job_id)
        if state.staged_version == r.version:
            state.staged_version = 0

    def _finish(self, r: Round, outcome: int, now: float) -> None:
        r.phase, r.outcome = Phase.DONE, outcome
        self.running.remove(r)
        if outcome == ACTIVE:
            logger.info("round %s v%d active on %s", r.job_id, r.version,
                        ", ".join(rid for rid, m in r.members.items() if m.active) or "no replicas",
                        extra={"job_id": r.job_id, "version": r.version, "catch_up": r.catch_up})
        if not r.catch_up:
            queue = self.queued.get(r.job_id)
            if queue:
                self._start(queue.popleft(), now)
        self.on_done(r)


def _where(member: Member) -> str:
    """'inline', 'collective rank 1', 'collective ranks 1-2' (one per receiving worker)."""
    stage = member.stage
    if member.transport != "collective":
        return member.transport
    if stage.rank_count > 1:
        return f"collective ranks {stage.rank}-{stage.rank + stage.rank_count - 1}"
    return f"collective rank {stage.rank}"
