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
