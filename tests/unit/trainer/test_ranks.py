"""RankGroup and the follower loop in two real gloo processes: a follower's failure reaches rank 0 as a clear
error (and marks the job diverged until a checkpoint loads), and an iterator abandoned by rank 0's consumer
still runs to its end on every rank, so the next command finds the ranks in step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorarl.assets import DENSE_MODEL_DIR
from lorarl.common.errors import FailedPreconditionError, InternalError
from lorarl.trainer.engines.api import CheckpointInfo, TrainingSpec
from lorarl.trainer.engines.torch.engine import TorchEngine
from tests.support.workers import run_workers
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch


class FailsOnRankOne(TorchEngine):
    """A torch engine whose optim_step fails on rank 1 only (as an out-of-memory there would)."""

    def optim_step(self, lr: float | None = None, adam=None):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            self._pending_grads = False
            raise RuntimeError("boom on rank 1")
        return super().optim_step(lr, adam)

    def save_checkpoint(self, path, data_cursor=None):
        """Rank 0 writes (the ranks hold the same weights, as under DataParallelEngine): two ranks renaming
        their temporary directories onto one path would race."""
        import torch.distributed as dist

        if dist.get_rank() == 0:
            return super().save_checkpoint(path, data_cursor)
        return CheckpointInfo(Path(path), self.step, self.version, data_cursor)


def factory(spec: TrainingSpec) -> TorchEngine:
    return FailsOnRankOne(spec)


def worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    from lorarl.trainer.ranks.control import ControlChannel
    from lorarl.trainer.ranks.follower import follow
    from lorarl.trainer.ranks.group import RankGroup
    from lorarl.trainer.ranks.launch import RankWorld, join_groups
    from lorarl.trainer.ranks.rank_engines import RankEngines

    torch.set_num_threads(1)
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    world = RankWorld(rank, world_size, rank, host, int(port), launched=True)
    channel = ControlChannel(join_groups("cpu", world, 60), rank, world_size)
    engines = RankEngines(rank, world_size, factory)
    if rank:
        follow(channel, engines)
        dist.destroy_process_group()
        return
    group = RankGroup(channel, engines, "cpu")
    try:
        engine = group.create_engine(make_spec(DENSE_MODEL_DIR, lr=1e-2))
        batch = synthetic_batch(0)
        engine.save_checkpoint(Path(out_dir) / "ckpt")
        engine.forward_backward(batch)
        with pytest.raises(InternalError, match=r"trainer rank 1 failed optim_step on engine-1: RuntimeError: boom"):
            engine.optim_step()
        for call in (lambda: engine.compute_logprobs(batch), lambda: engine.save_checkpoint(Path(out_dir) / "bad")):
            with pytest.raises(FailedPreconditionError, match="diverged"):
                call()
        engine.load_checkpoint(Path(out_dir) / "ckpt")  # loads on every rank: the job is usable again
        assert len(engine.compute_logprobs(batch)) == len(batch)

        stream = engine.iter_adapter_tensors()
        first = next(stream)  # rank 0's consumer stops after one tensor; the others read theirs to the end
        stream.close()
        assert first[0].endswith(".weight")
        names = [n for n, _ in engine.iter_base_tensors()]  # the next command runs in step
        assert names and group.broken is None
        engine.close()
        assert engine.key not in engines.engines
    finally:
        group.stop()
        dist.destroy_process_group()


@pytest.mark.slow
def test_follower_failures_are_reported_and_iterators_stay_in_step(tmp_path: Path) -> None:
    run_workers(worker, 2, (str(tmp_path),), timeout_s=120)
