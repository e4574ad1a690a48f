"""A worker extension for tests that must reach into vLLM's worker process (the engine core is a child
process, and collective_rpc sends names, never pickled callables): start an engine with
``engine.EXTENSION_QUALNAME`` set to ``QUALNAME``."""

from __future__ import annotations

import types
from typing import Any

from lorarl.rollout.vllm import compat
from lorarl.rollout.vllm.worker_ext import LorarlWorkerExtension

QUALNAME = "tests.support.vllm_worker.TestWorkerExtension"


class TestWorkerExtension(LorarlWorkerExtension):
    def lorarl_test_install_loader(self, source: str | None) -> str:
        """The served model's inner module loads with ``source``'s ``load_weights`` (another vLLM release's,
        compiled against this one's helpers); None: with its own again. Returns the module's class name."""
        from vllm.model_executor.model_loader import weight_utils
        from vllm.model_executor.models import qwen2, utils

        inner = compat.served_model(self).model
        if source is None:
            inner.__dict__.pop("load_weights", None)
            return ""
        namespace: dict[str, Any] = {**vars(qwen2), "default_weight_loader": weight_utils.default_weight_loader,
                                     "maybe_remap_kv_scale_name": weight_utils.maybe_remap_kv_scale_name,
                                     "is_pp_missing_parameter": utils.is_pp_missing_parameter}
        exec(compile(source, "<another vLLM's load_weights>", "exec"), namespace)
        inner.load_weights = types.MethodType(namespace["load_weights"], inner)
        return type(inner).__name__

    def lorarl_test_dry_run(self, shapes: dict[str, tuple[str, list[int]]], unwrap: bool) -> dict[str, list[str]]:
        from lorarl.rollout.vllm.weight_names import _dry_run

        return _dry_run(compat.served_model(self), shapes, unwrap=unwrap)

    def lorarl_test_shared_storage(self) -> dict[str, bool]:
        """Per parameter of the served model: whether all of its bytes lie in the shared base's mapping
        (lorarl.rollout.vllm.shared_loader keeps the segment on the model)."""
        import warnings

        import torch

        model = compat.served_model(self)
        segment = model.lorarl_segment
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            start = torch.frombuffer(segment.buffer, dtype=torch.uint8, count=1).data_ptr()
        end = start + segment.nbytes
        return {name: start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end
                for name, p in model.named_parameters()}

    def lorarl_test_reference_digests(self, checkpoint: str) -> dict[str, str]:
        """sha256 of each parameter as vLLM's own loader fills it from the safetensors file ``checkpoint``, loaded
        into scratch parameters swapped in for the call (the served ones, views of the shared base, are put back
        untouched): where the model's real loader puts every checkpoint tensor."""
        import hashlib

        import torch
        from safetensors.torch import load_file

        model = compat.served_model(self)
        served = {name: param.data for name, param in model.named_parameters()}
        scratch = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in served.items()}
        params = dict(model.named_parameters())
        for name, param in params.items():
            param.data = scratch[name]
        try:
            model.load_weights(iter(load_file(checkpoint).items()))
            scratch = {name: param.data for name, param in params.items()}  # a loader may swap .data itself
        finally:
            for name, param in params.items():
                param.data = served[name]
        return {name: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for name, t in scratch.items()}

