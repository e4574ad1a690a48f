"""A follower rank of the trainer: no gRPC, just rank 0's commands, run in lockstep until told to stop.

Started by rank 0 (`python -m lorarl.trainer.ranks.follower`, trainer.ranks > 1) or by torchrun on every
rank but 0 (lorarl.trainer.service.server.serve_forever). Each command is decoded, run on this rank's
engines (iterators to their end, their tensors discarded), and answered with a status: '' or the
error text, which rank 0 turns into a clear failure of the call.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from lorarl.trainer.ranks.commands import decode
from lorarl.trainer.ranks.control import ControlChannel
from lorarl.trainer.ranks.launch import RankWorld, join_groups
from lorarl.trainer.ranks.rank_engines import RankEngines

logger = logging.getLogger(__name__)


def follow(channel: ControlChannel, engines: RankEngines) -> None:
    """Runs commands from rank 0 until a `stop` command."""
    while True:
        data = channel.broadcast()
        error: BaseException | None = None
        stop = False
        try:
            command = decode(data)
            stop = command.op == "stop"
            result = engines.run(command)
            if command.op == "iter":
                for _ in result:  # the stream holds collectives: follow it to the end
                    pass
        except Exception as e:
            error = e
            logger.warning("rank %d: command failed: %s: %s", channel.rank, type(e).__name__, e)
        channel.gather_status("" if error is None else f"{type(error).__name__}: {error}")
        if stop:
            return


def run_follower(device: str, world: RankWorld, timeout_s: float) -> None:
    """Joins the ranks and follows rank 0 until it says stop."""
    import torch.distributed as dist

    control = join_groups(device, world, timeout_s)
    logger.info("trainer rank %d of %d following rank 0", world.rank, world.world_size)
    follow(ControlChannel(control, world.rank, world.world_size), RankEngines(world.local_rank, world.world_size))
    logger.info("trainer rank %d stopping", world.rank)
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """A follower rank 0 started must not outlive it (e.g. rank 0 was SIGKILLed)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            logger.error("rank 0 (pid %d) is gone; exiting", parent_pid)
            os._exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    from lorarl.common.log import configure_logging

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="text")
    args = parser.parse_args(argv)
    world = RankWorld.discover(1)
    if not world.launched or world.rank == 0:
        parser.error("a follower needs RANK >= 1 and WORLD_SIZE in its environment (rank 0 serves gRPC)")
    configure_logging(f"trainer-rank{world.rank}", level=args.log_level, fmt=args.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when its followers stop
    if args.parent_pid:
        threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    run_follower(args.device, world, args.timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
