"""Where a trainer process stands among its ranks, and how the ranks start and join.

Two launches share this code. `trainer.ranks=N` on one host: the service process is rank 0 and
starts ranks 1..N-1 itself (`python -m lorarl.trainer.ranks.follower`, with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT on a free loopback port). torchrun (RANK and WORLD_SIZE
already set, possibly across nodes): rank 0 serves gRPC, every other rank follows, nothing is
spawned. Either way each rank joins the default group (gloo on CPU, nccl on CUDA, hccl on NPU)
and then a separate gloo group for commands.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lorarl.common.config import ConfigError
from lorarl.common.ports import free_port

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankWorld:
    """This process's rank, the world size, its local rank and the rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    #: True when a launcher (torchrun, or rank 0 for its followers) set the environment.
    launched: bool

    @classmethod
    def discover(cls, ranks: int, env: Mapping[str, str] | None = None) -> RankWorld:
        """From RANK/WORLD_SIZE if a launcher set them, else a `ranks`-process world this process will start."""
        env = os.environ if env is None else env
        if "RANK" in env and "WORLD_SIZE" in env:
            world = int(env["WORLD_SIZE"])
            if ranks not in (1, world):
                raise ConfigError("trainer.ranks", f"is {ranks} but the launcher's WORLD_SIZE is {world}: under "
                                                   "torchrun the launcher decides (leave trainer.ranks at 1)")
            rank = int(env["RANK"])
            return cls(rank, world, int(env.get("LOCAL_RANK", rank)), env.get("MASTER_ADDR", "127.0.0.1"),
                       int(env.get("MASTER_PORT", "29500")), launched=True)
        return cls(0, ranks, 0, "127.0.0.1", free_port() if ranks > 1 else 0, launched=False)

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    def env_for(self, rank: int) -> dict[str, str]:
        """The launcher environment of follower `rank` on this host."""
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


class FollowerProcesses:
    """The follower ranks rank 0 started on this host: their exit codes, and stopping them."""

    def __init__(self, processes: dict[int, subprocess.Popen[bytes]]) -> None:
        self.processes = processes

    @classmethod
    def spawn(cls, world: RankWorld, device: str, timeout_s: float, log_level: str = "info",
              log_format: str = "text") -> FollowerProcesses:
        processes: dict[int, subprocess.Popen[bytes]] = {}
        for rank in range(1, world.world_size):
            command = [sys.executable, "-m", "lorarl.trainer.ranks.follower", "--device", device,
                       "--timeout-s", str(timeout_s), "--parent-pid", str(os.getpid()),
                       "--log-level", log_level, "--log-format", log_format]
            processes[rank] = subprocess.Popen(command, env={**os.environ, **world.env_for(rank)})
            logger.info("started trainer rank %d (pid %d)", rank, processes[rank].pid)
        return cls(processes)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.processes.items()}

    def exit_report(self, wait_s: float = 0.0) -> str | None:
        """'trainer rank R (pid P) exited with code C' for the first follower that exited, else None.

        ``wait_s`` gives a follower that is dying (its peers already saw the connection drop) time to be reaped.
        """
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in self.processes.items():
                code = process.poll()
                if code is not None:
                    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
                    return f"trainer rank {rank} (pid {process.pid}) exited with {how}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Waits for the followers to leave, SIGTERMs those that do not, SIGKILLs what outlives the bound."""
        for action in (None, signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.processes.values() if p.poll() is None]
            if not alive:
                return
            for process in alive:
                if action is not None:
                    process.send_signal(action)
            for process in alive:
                try:
                    process.wait(timeout=timeout_s / 2 if action is None else timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("trainer rank pid %d still running", process.pid)


def join_groups(device: str, world: RankWorld, timeout_s: float, processes: FollowerProcesses | None = None):
    """Joins the default group (the device's backend) and creates the gloo control group; returns the latter.

    Runs the rendezvous on a daemon thread so that a follower dying before it joins fails the start at
    once (RuntimeError naming it) instead of after the whole timeout.
    """
    import torch.distributed as dist

    from lorarl.trainer.engines.distributed import init_distributed, rank_store
    from lorarl.trainer.ranks.rank_engines import rank_device

    group: list[Any] = []
    errors: list[BaseException] = []

    def rendezvous() -> None:
        try:
            # Rank 0 of ranks it starts itself hosts the store on master_addr only; followers and ranks under
            # torchrun (whose agent hosts the store) connect through init_method.
            store = rank_store(world.master_addr, world.master_port, 0, world.world_size, timeout_s) \
                if world.rank == 0 and not world.launched else None
            init_distributed(rank_device(device, world.local_rank, world.world_size), world.rank, world.world_size,
                             world.init_method, timeout_s, store=store)
            group.append(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
        except BaseException as e:  # reported to the caller below
            errors.append(e)

    thread = threading.Thread(target=rendezvous, name="trainer-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        report = processes.exit_report() if processes is not None else None
        if report is not None:
            raise RuntimeError(f"{report} before the ranks joined")
    if errors:
        raise RuntimeError(f"trainer rank {world.rank} could not join the other {world.world_size - 1} ranks at "
                           f"{world.init_method}: {errors[0]}") from errors[0]
    return group[0]
