"""Checks on incoming trajectories, and the bounded buffer that holds the accepted ones.

Validation happens at the door, one trajectory at a time, so a bad one is refused with the name of
its offending field (later INVALID_ARGUMENT) and never poisons a training step or its neighbours.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from lorarl.contract.routes import RoutesError
from lorarl.contract.training import TOKEN_LOSSES
from lorarl.trainer.engines.api import FINISH_REASONS, LimitsSpec, LossSpec, TrajectoryRecord

logger = logging.getLogger(__name__)

#: Largest positive behaviour logprob accepted. Samplers compute log_softmax in low precision and a
#: near-certain token can come back as a tiny positive number (e.g. 2e-6); anything above this is a
#: bug on the client side (a probability, a negated value, garbage), not rounding.
LOGPROB_TOLERANCE = 1e-4


class InvalidTrajectory(ValueError):  # noqa: N818  (the name the trainer API documents)
    """A trajectory the trainer refuses; ``field`` names the offending Trajectory field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class BufferFullError(RuntimeError):
    """The job's trajectory buffer is at capacity (later RESOURCE_EXHAUSTED); train, then push again."""


def _check_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidTrajectory(field, f"token id {token} at index {i} is outside the vocabulary [0, {vocab_size})")


def check_advantages_fit(rec: TrajectoryRecord, loss: LossSpec) -> None:
    """Per-token advantages go with the losses that read them, and those that need them have them: never
    a caller's advantages silently dropped, nor a sampler's loss run on zeros."""
    if rec.token_advantages is not None and not loss.takes_token_advantages:
        raise InvalidTrajectory("token_advantages", f"are read only by the token losses ({', '.join(TOKEN_LOSSES)}); "
                                                    f"this loss ({loss.type}) takes its advantages from `reward` by "
                                                    "group")
    if rec.token_advantages is None and loss.takes_token_advantages and loss.type != "cross_entropy":
        raise InvalidTrajectory("token_advantages", f"are needed by loss {loss.type} (one per completion token)")
    if rec.teacher_logprobs is None and loss.distills:
        raise InvalidTrajectory("teacher_logprobs", f"are needed by loss {loss.type} with distill_weight "
                                                    f"{loss.distill_scale} (one per completion token: the job's "
                                                    "teachers score them in the rollout)")
    if rec.teacher_logprobs is not None and not loss.distills:
        raise InvalidTrajectory("teacher_logprobs", f"are read only with a distillation weight (loss opd, or "
                                                    f"distill_weight > 0); this loss ({loss.type}) has none")


@dataclass(frozen=True)
class RouteRule:
    """What a job does with a trajectory's routed experts: ``shape`` (MoE layers, top_k, experts) its engine
    replays, None: it cannot; ``ignore``: the job's routing_replay is 'off' (routes are dropped, as asked)."""

    shape: tuple[int, int, int] | None = None
    ignore: bool = False

    def check(self, rec: TrajectoryRecord) -> None:
        if rec.routes_problem is not None:
            field, problem = rec.routes_problem
            raise InvalidTrajectory(f"routed_experts.{field}", problem)
        if rec.routes is None:
            return
        if self.ignore:
            rec.routes = None
            return
        if self.shape is None:
            raise InvalidTrajectory("routed_experts", "this job cannot replay routes (its model has no MoE router the "
                                                      "engine replays); send none, or create the job with "
                                                      "routing_replay 'off'")
        try:
            rec.routes.check_fits(rec.num_tokens, *self.shape)
        except RoutesError as e:
            raise InvalidTrajectory(f"routed_experts.{e.field}", e.problem) from None


@dataclass
class FingerprintRule:
    """The served-policy check: ``published`` holds the fingerprints of the versions this job published (weight
    sync's digest of each payload); a trajectory naming another for one of them was produced by other weights
    than its versions claim. ``action``: 'refuse' (InvalidTrajectory), 'flag' (accepted, counted in
    ``flagged``), 'off'."""

    published: dict[int, frozenset[str]] = field(default_factory=dict)
    action: str = "refuse"
    flagged: int = 0
    #: Versions remembered: a trajectory older than these many versions is not checked (nothing to compare).
    keep: int = 256

    def record(self, version: int, fingerprints: Sequence[str]) -> None:
        if fingerprints:
            self.published[version] = frozenset(fingerprints)
        for old in [v for v in self.published if v <= version - self.keep]:
            del self.published[old]

    def check(self, rec: TrajectoryRecord) -> None:
        if self.action == "off":
            return
        for version, served in sorted(rec.fingerprints.items()):
            known = self.published.get(version)
            if known is None or served in known:
                continue
            if self.action == "flag":
                self.flagged += 1
                logger.warning("trajectory %s: version %d was served with weights %s, not the %s published",
                               rec.id or "?", version, served, sorted(known))
                return
            raise InvalidTrajectory("policy_fingerprints", f"version {version} was served with weights {served}, "
                                                           f"but this trainer published {sorted(known)} as it: the "
                                                           "rollout served other weights under that version")


def validate_trajectory(rec: TrajectoryRecord, vocab_size: int, current_version: int, limits: LimitsSpec,
                        loss: LossSpec | None = None, routes: RouteRule | None = None,
                        fingerprints: FingerprintRule | None = None) -> None:
    """Raises InvalidTrajectory for the first problem found; returns None when the trajectory is usable.
    ``loss``: the loss it will train under, for the per-token advantages (None: not checked here); ``routes``:
    what the job does with routed experts (None: a job that replays none)."""
    n = len(rec.completion_token_ids)
    if not rec.prompt_token_ids:
        raise InvalidTrajectory("prompt_token_ids", "is empty; the first completion token is predicted from the prompt")
    if n == 0:
        raise InvalidTrajectory("completion_token_ids", "is empty; there is nothing to learn from")
    if len(rec.behavior_logprobs) != n:
        raise InvalidTrajectory("behavior_logprobs",
                                f"has {len(rec.behavior_logprobs)} entries for {n} completion tokens")
    if len(rec.token_versions) != n:
        raise InvalidTrajectory("token_versions", f"has {len(rec.token_versions)} entries for {n} completion tokens")
    if rec.loss_mask is not None and len(rec.loss_mask) != n:
        raise InvalidTrajectory("loss_mask", f"has {len(rec.loss_mask)} entries for {n} completion tokens "
                                             "(empty: every token is the policy's)")
    if rec.trained_tokens == 0:
        raise InvalidTrajectory("loss_mask", "marks no token as the policy's; there is nothing to learn from")
    if rec.turn_rewards and len(rec.turn_rewards) != rec.policy_turns():
        raise InvalidTrajectory("turn_rewards", f"has {len(rec.turn_rewards)} entries for {rec.policy_turns()} "
                                                "policy turns (runs of loss_mask true)")
    for i, value in enumerate(rec.turn_rewards):
        if not math.isfinite(value):
            raise InvalidTrajectory("turn_rewards", f"entry {i} is {value}, not a finite number")
    if rec.token_advantages is not None:
        if len(rec.token_advantages) != n:
            raise InvalidTrajectory("token_advantages", f"has {len(rec.token_advantages)} entries for {n} completion "
                                                        "tokens (empty: none given)")
        for i, value in enumerate(rec.token_advantages):
            if not math.isfinite(value):
                raise InvalidTrajectory("token_advantages", f"entry {i} is {value}, not a finite number")
    if rec.teacher_logprobs is not None:
        if len(rec.teacher_logprobs) != n:
            raise InvalidTrajectory("teacher_logprobs", f"has {len(rec.teacher_logprobs)} entries for {n} "
                                                        "completion tokens (empty: none given)")
        for i, (value, trained_token) in enumerate(zip(rec.teacher_logprobs, rec.trained(), strict=True)):
            if trained_token and not (math.isfinite(value) and value <= 0.0):
                raise InvalidTrajectory("teacher_logprobs", f"entry {i} is {value}, not a log-probability "
                                                            "(finite, <= 0)")
    if loss is not None:
        check_advantages_fit(rec, loss)
    trained = rec.trained()
    total = len(rec.prompt_token_ids) + n
    if total > limits.max_sequence_tokens:
        raise InvalidTrajectory("completion_token_ids",
                                f"prompt + completion is {total} tokens, above max_sequence_tokens "
                                f"{limits.max_sequence_tokens}")
    _check_ids("prompt_token_ids", rec.prompt_token_ids, vocab_size)
    _check_ids("completion_token_ids", rec.completion_token_ids, vocab_size)
    for i, lp in enumerate(rec.behavior_logprobs):
        if not trained[i]:
            continue  # a tool or environment token: its logprob is not read
        if not math.isfinite(lp):
            raise InvalidTrajectory("behavior_logprobs", f"entry {i} is {lp}, not a finite number")
        if lp > LOGPROB_TOLERANCE:
            raise InvalidTrajectory("behavior_logprobs", f"entry {i} is {lp}; a log-probability must be <= 0")
    for i, v in enumerate(rec.token_versions):
        if not trained[i]:
            continue
        if v < 0:
            raise InvalidTrajectory("token_versions", f"entry {i} is negative ({v})")
        if v > current_version:
            raise InvalidTrajectory("token_versions",
                                    f"entry {i} is version {v}, ahead of the trainer's version {current_version}")
    if not math.isfinite(rec.reward):
        raise InvalidTrajectory("reward", f"is {rec.reward}, not a finite number")
    if rec.finish_reason not in FINISH_REASONS:
        raise InvalidTrajectory("finish_reason", f"is {rec.finish_reason!r}, expected one of {list(FINISH_REASONS)}")
    (routes or RouteRule()).check(rec)
    if fingerprints is not None:
        fingerprints.check(rec)


class TrajectoryBuffer:
    """Accepted trajectories waiting for a training step, bounded by ``limits.max_buffered_trajectories``.

    Thread-safe (gRPC handlers push concurrently). Every item is validated on its own: a rejected
    one never removes or blocks those accepted before or after it.
    """

    def __init__(self, vocab_size: int, limits: LimitsSpec, loss: LossSpec | None = None,
                 routes: RouteRule | None = None, fingerprints: FingerprintRule | None = None) -> None:
        self.vocab_size = vocab_size
        self.limits = limits
        self.loss = loss  # the job's: buffered trajectories train under it
        self.routes = routes
        self.fingerprints = fingerprints or FingerprintRule()
        self._items: list[TrajectoryRecord] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def capacity(self) -> int:
        return self.limits.max_buffered_trajectories

    def push(self, rec: TrajectoryRecord, current_version: int) -> None:
        """Validates and appends one trajectory; raises InvalidTrajectory or BufferFullError."""
        validate_trajectory(rec, self.vocab_size, current_version, self.limits, self.loss, self.routes,
                            self.fingerprints)
        with self._lock:
            if len(self._items) >= self.capacity:
                raise BufferFullError(f"trajectory buffer is full ({self.capacity} trajectories); "
                                 "run a training step before pushing more")
            self._items.append(rec)

    def push_many(self, records: Sequence[TrajectoryRecord], current_version: int
                  ) -> list[InvalidTrajectory | BufferFullError | None]:
        """One status per record, in order: None when accepted, else the error that refused it."""
        statuses: list[InvalidTrajectory | BufferFullError | None] = []
        for rec in records:
            try:
                self.push(rec, current_version)
                statuses.append(None)
            except (InvalidTrajectory, BufferFullError) as e:
                statuses.append(e)
        return statuses

    def pop_batch(self, max_items: int = 0) -> list[TrajectoryRecord]:
        """Removes and returns the oldest whole groups, at most ``max_items`` trajectories (0: all).

        Groups are never split, since advantages are relative to the group; a first group larger
        than ``max_items`` is returned whole rather than starving.
        """
        with self._lock:
            if max_items <= 0 or max_items >= len(self._items):
                batch, self._items = self._items, []
                return batch
            order: list[object] = []
            members: dict[object, list[int]] = {}
            for i, rec in enumerate(self._items):
                key = rec.group_key()
                if key not in members:
                    order.append(key)
                members.setdefault(key, []).append(i)
            chosen: set[int] = set()
            for key in order:
                if chosen and len(chosen) + len(members[key]) > max_items:
                    break
                chosen.update(members[key])
            batch = [rec for i, rec in enumerate(self._items) if i in chosen]
            self._items = [rec for i, rec in enumerate(self._items) if i not in chosen]
            return batch

    def restore(self, records: Sequence[TrajectoryRecord]) -> None:
        """Puts a popped batch back in front (e.g. after a failed step); capacity is not enforced."""
        with self._lock:
            self._items = list(records) + self._items

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
