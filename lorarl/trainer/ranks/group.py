"""Rank 0 of a multi-rank trainer: every engine call goes to all ranks, in lockstep, or fails loudly.

`RankGroup` owns the command channel: under one lock it broadcasts a command (lorarl.trainer.ranks.commands),
runs the decoded command on rank 0's own engines, then all-gathers every rank's status. A follower
that failed where rank 0 did not is an error, never silence: the caller gets it, and the job's
ranks are marked diverged until a checkpoint loads on all of them. A dead follower or a broken
channel makes the group unusable (UNAVAILABLE from then on, and the service reports NOT_SERVING).
A monitor thread watches the follower processes and pings idle followers, so a lost rank is noticed
before the next call and an idle follower never hits the channel's timeout.

`LockstepEngine` is what the JobManager holds: a TrainEngine whose methods are commands and whose
properties read rank 0's engine (identical on every rank).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorarl.common.errors import FailedPreconditionError, InternalError, InvalidArgumentError, UnavailableError
from lorarl.trainer.engines.api import AdamStep, CheckpointInfo, Metrics, TrainEngine, TrainingSpec, TrajectoryRecord
from lorarl.trainer.ranks.commands import Command, decode, encode
from lorarl.trainer.ranks.control import ControlChannel
from lorarl.trainer.ranks.launch import FollowerProcesses, RankWorld, join_groups
from lorarl.trainer.ranks.rank_engines import RankEngines, check_job_fits
from lorarl.trainer.rl.losses import LossSpec

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
#: Calls whose failure on some ranks only leaves the ranks' engines in different states.
STATEFUL = ("forward_backward", "optim_step", "train_step", "load_checkpoint", "renumber")


def status_of(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"


class RankGroup:
    """Rank 0's end of the command channel (see module docstring)."""

    def __init__(self, channel: ControlChannel, engines: RankEngines, device: str,
                 processes: FollowerProcesses | None = None, heartbeat_s: float = 30.0) -> None:
        self.channel, self.engines, self.device, self.processes = channel, engines, device, processes
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._broken: str | None = None
        self._diverged: dict[str, str] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._last_command = time.monotonic()
        self._stopping = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="trainer-ranks", daemon=True)
        self._monitor.start()

    @classmethod
    def start(cls, device: str, world: RankWorld, timeout_s: float, log_level: str = "info",
              log_format: str = "text") -> RankGroup:
        """Rank 0: starts the followers (unless a launcher did), joins them and returns the group."""
        processes = None if world.launched else FollowerProcesses.spawn(world, device, timeout_s, log_level,
                                                                          log_format)
        try:
            control = join_groups(device, world, timeout_s, processes)
        except BaseException:
            if processes is not None:
                processes.stop(5.0)
            raise
        logger.info("trainer ranks joined: %d ranks, device %s", world.world_size, device)
        return cls(ControlChannel(control, 0, world.world_size), RankEngines(world.local_rank, world.world_size),
                   device, processes, heartbeat_s=min(30.0, timeout_s / 4))

    @property
    def world_size(self) -> int:
        return self.channel.world_size

    @property
    def broken(self) -> str | None:
        """Why the group cannot run commands any more (None while it can)."""
        return self._broken

    def on_broken(self, listener: Callable[[str], None]) -> None:
        """Calls listener(reason) once the group breaks (at once if it already has)."""
        self._listeners.append(listener)
        if self._broken is not None:
            listener(self._broken)

    # ------------------------------------------------------------ engines

    def create_engine(self, spec: TrainingSpec) -> LockstepEngine:
        """Builds the job's engine on every rank (the JobManager's engine factory)."""
        problem = check_job_fits(spec, self.world_size, self.device)
        if problem is not None:
            raise InvalidArgumentError(*problem)
        key = f"engine-{next(self._keys)}"
        try:
            self.execute(Command("create", key, args={"spec": spec}))
        except BaseException:
            if self._broken is None:  # some ranks may have built it: forget it everywhere
                try:
                    self.execute(Command("close", key))
                except Exception:
                    logger.exception("could not forget the half-built engine %s", key)
            raise
        return LockstepEngine(self, key, self.engines.engine(key))

    def close_engine(self, key: str) -> None:
        self._diverged.pop(key, None)
        if self._broken is None:
            self.execute(Command("close", key))
        else:
            self.engines.engines.pop(key, None)

    # ------------------------------------------------------------ commands

    def execute(self, command: Command) -> Any:
        """Runs a create/call/close command on every rank; rank 0's result, or the first error."""
        with self._lock:
            decoded = self._send(command)
            error: BaseException | None = None
            result = None
            try:
                result = self.engines.run(decoded)
            except Exception as e:
                error = e
            self._settle(decoded, error)
            return result

    def iterate(self, command: Command) -> Iterator[Any]:
        """Runs an iterator command on every rank; yields rank 0's items. The others consume theirs to the
        end, and so does rank 0 even if its consumer stops early (the stream holds collectives)."""
        with self._lock:
            decoded = self._send(command)
            error: BaseException | None = None
            left = False
            try:
                items = iter(self.engines.run(decoded))
                for item in items:
                    try:
                        yield item
                    except GeneratorExit:
                        left = True
                        for _ in items:
                            pass
                        break
            except Exception as e:
                error = e
            self._settle(decoded, error)
            if left:
                return

    def _send(self, command: Command) -> Command:
        """Checks the group and the job, broadcasts the command; the decoded command every rank runs."""
        if self._broken is not None:
            raise UnavailableError(f"the trainer's ranks are down ({self._broken}); restart the trainer")
        if command.op in ("call", "iter") and command.engine in self._diverged and command.method != "load_checkpoint":
            raise FailedPreconditionError(f"this job's ranks diverged ({self._diverged[command.engine]}); load a "
                                          "checkpoint or delete the job")
        data = encode(command)
        self._last_command = time.monotonic()
        try:
            self.channel.broadcast(data)
        except Exception as e:
            raise self._fail(e) from None
        return decode(data)

    def _settle(self, command: Command, error: BaseException | None) -> None:
        """Gathers every rank's status and raises rank 0's error, or a follower's."""
        try:
            statuses = self.channel.gather_status(status_of(error))
        except Exception as e:
            raise self._fail(e) from None
        failed = {rank: text for rank, text in enumerate(statuses) if rank and text}
        what = f"{command.method or command.op} on {command.engine or 'every engine'}"
        failed_ranks = sorted(failed) if error is None else [0, *sorted(failed)]
        if command.method in STATEFUL and 0 < len(failed_ranks) < self.world_size:
            self._diverged[command.engine] = f"{what} failed on ranks {failed_ranks} only"
        elif command.method == "load_checkpoint" and not failed_ranks:
            self._diverged.pop(command.engine, None)
        if error is not None:
            raise error
        if failed:
            rank, text = next(iter(failed.items()))
            raise InternalError(f"trainer rank {rank} failed {what}: {text}")

    # ------------------------------------------------------------ failures

    def _fail(self, cause: BaseException | str) -> UnavailableError:
        """Marks the group broken (once) and returns the error to raise."""
        if self._broken is None:
            reason = self.processes.exit_report(wait_s=2.0) if self.processes is not None else None
            self._broken = reason or (cause if isinstance(cause, str) else
                                      f"lost contact with the other ranks: {type(cause).__name__}: {cause}")
            logger.error("trainer ranks broken: %s", self._broken)
            for listener in self._listeners:
                try:
                    listener(self._broken)
                except Exception:
                    logger.exception("broken-ranks listener failed")
        return UnavailableError(f"the trainer's ranks are down ({self._broken}); restart the trainer")

    def _watch(self) -> None:
        """Notices dead followers at once and pings idle ones (so they never time out waiting)."""
        while not self._stopping.wait(0.2):
            if self._broken is not None:
                return
            if self.processes is not None and self.processes.exit_report() is not None:
                self._fail("a follower exited")
                return
            if time.monotonic() - self._last_command < self.heartbeat_s or not self._lock.acquire(blocking=False):
                continue
            try:
                if self._broken is None and not self._stopping.is_set():
                    self._send(Command("ping"))
                    self._settle(Command("ping"), None)
            except Exception:
                logger.exception("heartbeat failed")
            finally:
                self._lock.release()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tells the followers to leave (then stops their processes, if this rank started them)."""
        self._stopping.set()
        if self._lock.acquire(timeout=timeout_s):
            try:
                if self._broken is None:
                    self._send(Command("stop"))
                    self._settle(Command("stop"), None)
                    self._broken = "the trainer stopped"
            except Exception:
                logger.warning("followers did not acknowledge the stop", exc_info=True)
            finally:
                self._lock.release()
        if self.processes is not None:
            self.processes.stop(timeout_s)


class LockstepEngine(TrainEngine):
    """A TrainEngine on every rank at once: methods are commands, properties are rank 0's engine's."""

    def __init__(self, group: RankGroup, key: str, local: TrainEngine) -> None:
        self.group, self.key, self.local = group, key, local
        self.spec = local.spec

    @classmethod
    def create(cls, spec: TrainingSpec) -> LockstepEngine:
        raise TypeError("a LockstepEngine is made by RankGroup.create_engine")

    def _call(self, method: str, **args: Any) -> Any:
        return self.group.execute(Command("call", self.key, method, args))

    def _iterate(self, method: str) -> Iterator[tuple[str, torch.Tensor]]:
        return self.group.iterate(Command("iter", self.key, method))

    def forward_backward(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        return self._call("forward_backward", batch=list(batch), loss=loss)

    def optim_step(self, lr: float | None = None, adam: AdamStep | None = None) -> Metrics:
        return self._call("optim_step", lr=lr, adam=adam)

    def train_step(self, batch: Sequence[TrajectoryRecord], loss: LossSpec | None = None) -> Metrics:
        return self._call("train_step", batch=list(batch), loss=loss)

    def compute_logprobs(self, batch: Sequence[TrajectoryRecord], reference: bool = False) -> list[list[float]]:
        return self._call("compute_logprobs", batch=list(batch), reference=reference)

    def save_checkpoint(self, path: str | Path, data_cursor: Any = None) -> CheckpointInfo:
        return self._call("save_checkpoint", path=path, data_cursor=data_cursor)

    def load_checkpoint(self, path: str | Path) -> CheckpointInfo:
        return self._call("load_checkpoint", path=path)

    def renumber(self, version: int) -> None:
        self._call("renumber", version=version)

    def export_adapter(self, path: str | Path) -> Path:
        return self._call("export_adapter", path=path)

    def export_merged(self, path: str | Path) -> Path:
        return self._call("export_merged", path=path)

    def iter_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iterate("iter_adapter_tensors")

    def iter_merged_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iterate("iter_merged_tensors")

    def iter_base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iterate("iter_base_tensors")

    def close(self) -> None:
        self.group.close_engine(self.key)

    @property
    def version(self) -> int:
        return self.local.version

    @property
    def step(self) -> int:
        return self.local.step

    @property
    def base_model_fingerprint(self) -> str:
        return self.local.base_model_fingerprint

    @property
    def trainable_parameters(self) -> int:
        return self.local.trainable_parameters

    def memory(self) -> tuple[int, int, int]:
        return self.local.memory()  # rank 0's: every rank holds its own shard of the same layout

    @property
    def total_parameters(self) -> int:
        return self.local.total_parameters

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def route_shape(self) -> tuple[int, int, int] | None:
        """Rank 0's engine's (routing replay, R3): routes travel to every rank with the batch's records."""
        return getattr(self.local, "route_shape", None)
