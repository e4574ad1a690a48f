"""The CPU patches make megatron's CUDA-only calls work on the host, and disable() restores the originals."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lorarl.trainer.engines.megatron import cpu_compat


@pytest.fixture
def patched() -> Iterator[None]:
    cpu_compat.enable()
    yield
    cpu_compat.disable()


def test_cuda_only_calls_run_on_the_host(patched: None) -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules

    assert torch.cuda.current_device() == torch.device("cpu")
    mask = fused_softmax.get_default_causal_mask(3)
    assert mask.device.type == "cpu" and mask.tolist() == [[False, True, True], [False, False, True], [False] * 3]
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"


def test_rng_tracker_streams_are_named_seeded_and_isolated(patched: None) -> None:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, CudaRNGStatesTracker)  # megatron's own isinstance checks still hold
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    torch.manual_seed(123)
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer)  # the default stream is untouched
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the named stream advances
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)  # and is reproducible from the seed
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=1, ep_rank=0, etp_rank=0)
    with tracker.fork():
        assert not torch.equal(torch.rand(4), first)  # another TP rank draws another stream


def test_disable_restores_the_originals() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    cpu_compat.disable()  # an earlier test in this process (a Megatron engine built in-process) may have enabled it
    original, tracker = torch.cuda.current_device, mrandom._CUDA_RNG_STATE_TRACKER
    cpu_compat.enable()
    cpu_compat.enable()  # idempotent
    assert cpu_compat.enabled() and torch.cuda.current_device is not original
    assert type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ == "CpuRNGStatesTracker"
    cpu_compat.disable()
    assert not cpu_compat.enabled() and torch.cuda.current_device is original
    assert mrandom._CUDA_RNG_STATE_TRACKER is tracker
