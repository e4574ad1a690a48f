"""Records, in a vLLM worker, the experts each MoE router chose for every token of every request (R3).

vLLM 0.32 returns routed experts itself (`enable_return_routed_experts`) only under its Model Runner V2, which
its CPU build cannot run (V2 needs Triton) and which vLLM 0.23 (vllm-ascend's line) predates; both lines'
routers do call a capture hook, `BaseRouter.set_capture_fn`, with each forward's top-k ids. So lorarl records
in the worker on every platform, one path that CI runs:

    router hook      each MoE layer's top-k ids of the forward's tokens      [tokens, k] per layer
    forward wrapper  the runner's `_model_forward`: which request owns which tokens (input_batch.req_ids,
                     query_start_loc) and at which positions (its `positions` argument)

and keeps, per vLLM request id, one row per position computed. `take` hands a request's rows over as a
lorarl.contract.routes array (positions never computed stay -1) and forgets them. A position computed twice
(a preempted request recomputed) keeps the later route. Prefix caching must be off while recording: a cached
position is never computed, so its route would be missing (the engine starts without it).

Memory is bounded: at most ``max_requests`` requests are kept; the oldest goes first (its routes then read as
not recorded). Only the first tensor-parallel rank records (the router is replicated: every rank routes alike).
The internals used are declared in lorarl/rollout/vllm/surface.py.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUESTS = 8192


def moe_routers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(layer index, router) of every MoE layer whose router takes a capture hook, in layer order."""
    found = []
    for module in model.modules():
        router = getattr(module, "router", None)
        if router is not None and callable(getattr(router, "set_capture_fn", None)) and hasattr(module, "layer_id"):
            found.append((int(module.layer_id), router))
    return sorted(found, key=lambda item: item[0])


class RouteRecorder:
    """Installed once per worker (`install`); `take` per finished request."""

    def __init__(self, layers: int, top_k: int, num_experts: int, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        self.layers, self.top_k, self.num_experts = layers, top_k, num_experts
        self.max_requests = max_requests
        self._step: list[torch.Tensor | None] = [None] * layers
        #: request id -> {position: [layers, top_k] int16}
        self._requests: OrderedDict[str, dict[int, np.ndarray]] = OrderedDict()
        self.evicted = 0
        self.silent_warned = False

    @classmethod
    def install(cls, runner: Any, model: torch.nn.Module, num_experts: int, top_k: int,
                max_requests: int = DEFAULT_MAX_REQUESTS) -> RouteRecorder:
        routers = moe_routers(model)
        if not routers:
            raise RuntimeError("no MoE router with a capture hook (BaseRouter.set_capture_fn) in the served model: "
                               "this vLLM cannot record routes")
        recorder = cls(len(routers), top_k, num_experts, max_requests)
        for index, (_, router) in enumerate(routers):
            router.set_capture_fn(lambda ids, i=index: recorder._capture(i, ids))
        forward = runner._model_forward

        def recorded_forward(*args: Any, **kwargs: Any) -> Any:
            recorder._step = [None] * recorder.layers
            out = forward(*args, **kwargs)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            recorder._assign(runner, positions)
            return out

        runner._model_forward = recorded_forward
        return recorder

    def _capture(self, layer: int, ids: torch.Tensor) -> None:
        self._step[layer] = ids.detach().to("cpu", torch.int16)

    def _assign(self, runner: Any, positions: torch.Tensor | None) -> None:
        """Files this forward's captured rows under the requests that own its tokens."""
        batch = runner.input_batch
        count = int(batch.num_reqs)
        if count == 0 or positions is None:
            return  # a dummy run (profiling, warm-up)
        if any(s is None for s in self._step):
            if not self.silent_warned:  # e.g. vllm-ascend, whose MoE kernel selects experts past the hook
                self.silent_warned = True
                logger.warning("recording routes: %d of %d MoE routers called no capture hook in a forward of %d "
                               "requests; their routes stay unrecorded (the trainer routes those live)",
                               sum(s is None for s in self._step), self.layers, count)
            return
        starts = np.asarray(runner.query_start_loc.np[: count + 1], dtype=np.int64)
        total = int(starts[-1])
        step = torch.stack([s[:total] for s in self._step if s is not None], dim=1).numpy()  # [tokens, layers, k]
        pos = positions.detach().to("cpu").reshape(-1)[:total].numpy()
        for req_id, begin, end in zip(batch.req_ids[:count], starts[:-1], starts[1:], strict=True):
            rows = self._requests.get(req_id)
            if rows is None:
                rows = self._requests[req_id] = {}
                if len(self._requests) > self.max_requests:
                    self._requests.popitem(last=False)
                    self.evicted += 1
            for t in range(int(begin), int(end)):
                rows[int(pos[t])] = step[t]

    def take(self, request_id: str) -> dict[str, Any] | None:
        """A request's routes as lorarl.contract.routes wire fields (int16 bytes), forgotten here; None: none."""
        rows = self._requests.pop(request_id, None)
        if not rows:
            return None
        n = max(rows) + 1
        ids = np.full((n, self.layers, self.top_k), -1, dtype=np.int16)
        for position, row in rows.items():
            ids[position] = row
        return {"data": ids.tobytes(), "positions": n, "layers": self.layers, "top_k": self.top_k,
                "num_experts": self.num_experts}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def pending(self) -> int:
        return len(self._requests)
