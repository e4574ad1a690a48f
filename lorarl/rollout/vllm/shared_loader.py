"""A vLLM model loader whose parameters ARE the co-located job's shared base (issue "one base").

Load format ``lorarl_shared_base`` (registered by the plugin): vLLM builds the model as usual (its parameters
allocated, never written: untouched pages cost no memory), then every parameter is replaced by a read-only view
of the shared memory file the launcher holds (lorarl.contract.base_segment), name for name and shape for shape;
a parameter the file lacks, a tensor of the file no parameter takes, or a shape or dtype that differs, stops
the engine's start with the name. Each parameter stays the same object (``param.data`` is swapped): its class,
vLLM's loader attributes and any tie (a tied output head) are kept.

vLLM CPU would then repack every linear weight for oneDNN and drop the original tensor
(``dispatch_cpu_unquantized_gemm``): a private packed copy of the base, which is what sharing removes. While this
loader runs, a layer whose weight is shared keeps it and computes on it with torch's GEMM instead
(``shared_linear``; generation speed against the packed path: bench/colocate.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

LOAD_FORMAT = "lorarl_shared_base"
#: Set on every parameter that is a view of the shared base.
SHARED_FLAG = "lorarl_shared"

logger = logging.getLogger(__name__)


def _loader_class() -> type:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from lorarl.contract.base_segment import open_segment

    class SharedBaseLoader(BaseModelLoader):
        """Maps the segment named by ``model_loader_extra_config`` = {"segment": path, "fingerprint": ...}."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            self.segment_path = extra.pop("segment", "")
            self.fingerprint = extra.pop("fingerprint", None)
            if not self.segment_path or extra:
                raise ValueError(f"load format {LOAD_FORMAT} takes model_loader_extra_config {{'segment': path, "
                                 f"'fingerprint': ...}}, got {load_config.model_loader_extra_config}")

        def download_model(self, model_config: Any) -> None:
            return None

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            segment = open_segment(self.segment_path, self.fingerprint)
            attach(model, segment.views())
            model.lorarl_segment = segment  # the mapping lives as long as the model

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            with shared_weights_unpacked():
                model = super().load_model(vllm_config, model_config, prefix)
            held = check_served_from(model, model.lorarl_segment)
            logger.info("shared base: all %d parameters of the served model lie in the shared segment (%.2f GiB)",
                        held, model.lorarl_segment.nbytes / 2**30)
            return model

    return SharedBaseLoader


def attach(model: nn.Module, views: dict[str, torch.Tensor]) -> int:
    """Replaces every parameter of ``model`` by its shared view; returns how many; ValueError naming what does not
    match (a parameter without a view, a view without a parameter, a shape or dtype)."""
    by_object: dict[int, list[str]] = {}
    objects: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(param), []).append(name)
        objects[id(param)] = param
    used: set[str] = set()
    problems: list[str] = []
    for key, names in by_object.items():
        source = next((n for n in names if n in views), None)
        if source is None:
            problems.append(f"parameter {names[0]} is not in the shared base")
            continue
        old, view = objects[key], views[source]
        if tuple(old.shape) != tuple(view.shape) or old.dtype != view.dtype:
            problems.append(f"{source}: the engine's parameter is {old.dtype} {list(old.shape)}, the shared base "
                            f"holds {view.dtype} {list(view.shape)}")
            continue
        used.add(source)
        # The same Parameter object (its class, vLLM's weight_loader and dims, a tie) over the shared bytes; the
        # never-written storage it was built with goes.
        old.data = view
        setattr(old, SHARED_FLAG, True)
    problems += [f"shared tensor {n} is no parameter of the engine's model" for n in sorted(set(views) - used)]
    if problems:
        raise ValueError("the shared base does not fit this engine's model: " + "; ".join(problems[:6])
                         + (f"; ... {len(problems) - 6} more" if len(problems) > 6 else ""))
    return len(used)


def check_served_from(model: nn.Module, segment: Any) -> int:
    """After vLLM's post-load processing: every parameter the engine computes with still lies in ``segment`` (none
    repacked, copied or emptied on the way); returns how many; ValueError naming those that do not (the engine
    does not start on a private copy that would silently double the base)."""
    params = dict(model.named_parameters())
    outside = sorted(name for name, param in params.items() if not segment.holds(param))
    if outside:
        raise ValueError(f"{len(outside)} of the engine's {len(params)} parameters do not lie in the shared base "
                         f"after loading (copied, repacked or emptied): {', '.join(outside[:6])}")
    return len(params)


#: Up to this many rows (decode batches), a shared weight computes as ``weight @ x.T``.
SKINNY_ROWS = 16


def shared_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on a shared (row-major, unpacked) weight. For a decode batch of a few rows the product is
    taken as ``weight @ x.T``: torch's CPU GEMM reads the [out, in] weight as it lies much faster that way than
    through ``x @ weight.T`` (at 8 rows, 1.3-1.7x on Qwen3-0.6B's projections and head here: bench/colocate.py
    names what generation speed the shared path keeps against vLLM's private packed copy)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.dim() < 2 or rows > SKINNY_ROWS or rows == 0:
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mm(weight, flat.t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def shared_weights_unpacked() -> Iterator[None]:
    """While inside, vLLM CPU's GEMM dispatch leaves shared weights as they are (torch linear on the view)."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: nn.Module, remove_weight: bool) -> None:
        if getattr(layer.weight, SHARED_FLAG, False):
            layer.cpu_linear = shared_linear
            return
        original(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def register() -> None:
    """Makes ``load_format=lorarl_shared_base`` known to vLLM in this process (idempotent)."""
    from vllm.model_executor import model_loader

    if LOAD_FORMAT not in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:
        model_loader.register_model_loader(LOAD_FORMAT)(_loader_class())
