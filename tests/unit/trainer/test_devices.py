"""Accelerator specifics (lorarl/trainer/engines/devices.py) against a stand-in for torch.npu.

torch_npu cannot be installed here; the stand-in has torch.npu's RNG API (the same as torch.cuda's),
so what is checked is lorarl's side: NPU generator states land in the checkpoint's tensors, keyed by
device, survive safetensors, and are put back device by device. UNTESTED on Ascend hardware.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, save

from lorarl.trainer.engines import checkpoint, devices
from lorarl.trainer.engines.api import TrainingSpec


class StandInNpu:
    """torch.npu's device and RNG calls, over CPU generators (one per device)."""

    def __init__(self, count: int) -> None:
        self.generators = [torch.Generator().manual_seed(100 + i) for i in range(count)]
        self.current: int | None = None

    def is_available(self) -> bool:
        return True

    def set_device(self, device: int) -> None:
        self.current = device

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [g.get_state() for g in self.generators]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for g, s in zip(self.generators, states, strict=True):
            g.set_state(s)

    def draw(self) -> list[float]:
        return [torch.rand(1, generator=g).item() for g in self.generators]


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> StandInNpu:
    stand_in = StandInNpu(count=11)  # > 10 devices: states must be put back by index, not by key order
    monkeypatch.setattr(devices, "accelerator", lambda kind: stand_in if kind == "npu" else None)
    return stand_in


def test_npu_rng_states_are_saved_and_restored_for_a_bit_exact_resume(npu: StandInNpu) -> None:
    tensors, plain = checkpoint.capture_rng(SimpleNamespace(type="npu"))  # type: ignore[arg-type]
    assert sorted(k for k in tensors if k.startswith("torch_npu_")) == sorted(f"torch_npu_{i}" for i in range(11))
    expected = npu.draw()
    npu.draw()  # the run goes on past the checkpoint
    checkpoint.restore_rng(load(save(tensors)), plain)  # through the checkpoint's safetensors
    assert npu.draw() == expected


def test_each_rank_binds_its_own_npu(npu: StandInNpu) -> None:
    devices.bind_device("npu")  # a type only: the rank's device is chosen by rank_device first
    assert npu.current is None
    devices.bind_device("npu:3")
    assert npu.current == 3


def test_without_the_accelerator_nothing_is_captured_or_restored() -> None:
    assert devices.capture_accelerator_rng(torch.device("cpu")) == {}
    assert devices.restore_accelerator_rng({"torch_cpu": torch.get_rng_state()}) == []


def test_megatron_on_npu_is_refused_naming_what_it_needs() -> None:
    with pytest.raises(ValueError, match=r"MindSpeed.*engine 'torch' on device 'npu'"):
        TrainingSpec(base_model_path="/m", device="npu", engine="megatron")
    assert TrainingSpec(base_model_path="/m", device="npu", engine="torch").device == "npu"
