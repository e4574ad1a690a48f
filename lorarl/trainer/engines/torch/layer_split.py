"""A base larger than one device, split by decoder layers across several devices of one trainer process.

The torch engine's answer to a frozen base that does not fit one accelerator (Qwen3-30B-A3B's 57 GiB of
bf16 on a 64 GiB Ascend 910B): the first device keeps the embeddings, the rotary tables, the final norm
and the LM head (so the step's batch tensors and the LM-head chunks never leave it); the decoder layers go
to the devices in contiguous runs, sized so that no device holds more parameter bytes than it must
(lorarl.trainer.engines.memory.stage_sizes, which `lorarl run --dry-run` applies too). A pre-forward
hook on every layer, and on the final norm, moves the tensors it is called with to its own device:
hidden states, rotary tables and masks cross a device boundary once per run of layers. There is no
pipelining: one device computes at a time, which costs nothing in memory and leaves the others idle
(the plan's step-time estimate counts one device).

Hand-written rather than accelerate's ``dispatch_model``: the engine only needs inputs moved to a layer's
device; accelerate's hooks also move outputs back, wrap ``.to()`` and offload, which the engine's own
head (reading ``lm_head.weight`` directly) and its checkpointed layer forward do not expect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lorarl.trainer.engines.memory import stage_sizes

_HOOK = "_lorarl_layer_split_hook"


def split_devices(device: str, count: int) -> list[torch.device]:
    """``count`` devices from ``device``'s index on (``npu`` -> npu:0, npu:1, ...); cpu repeats cpu."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return [torch.device("cpu")] * count
    start = int(index or 0)
    return [torch.device(f"{kind}:{start + i}") for i in range(count)]


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (tuples, lists and dicts followed) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return type(value)(*(to_device(v, device) for v in value)) if hasattr(value, "_fields") else tuple(
            to_device(v, device) for v in value)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def _inputs_to(device: torch.device):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return to_device(args, device), to_device(kwargs, device)

    return hook


def _parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def place_by_layers(model: nn.Module, devices: Sequence[torch.device]) -> list[int]:
    """Moves a transformers causal LM onto ``devices`` (see the module docstring); returns the layers per
    device. One device: ``model.to(device)``, no hooks."""
    if len(devices) == 1:
        model.to(devices[0])
        return [model.config.num_hidden_layers]
    decoder = model.get_decoder()
    layers: nn.ModuleList = decoder.layers
    per_layer = [_parameter_bytes(layer) for layer in layers]
    sizes = stage_sizes(_parameter_bytes(model) - sum(per_layer), per_layer, len(devices))
    index = 0
    for device, size in zip(devices, sizes, strict=True):  # layer by layer: the whole base is never on one device
        for layer in layers[index:index + size]:
            layer.to(device)
            _hook(layer, device)
        index += size
    _move_outside(model, layers, devices[0])
    _hook(decoder.norm, devices[0])  # back to the first device for the head
    return sizes


def _move_outside(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """Every parameter and buffer that is not a decoder layer's onto ``device`` (tied weights move once)."""
    inside = {id(t) for t in [*layers.parameters(), *layers.buffers()]}
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and id(param) not in inside and param.device != device:
                    param.data = param.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) not in inside and buffer.device != device:
                    module._buffers[name] = buffer.to(device)


def _hook(module: nn.Module, device: torch.device) -> None:
    if getattr(module, _HOOK, None) is None:
        setattr(module, _HOOK, module.register_forward_pre_hook(_inputs_to(device), with_kwargs=True))
