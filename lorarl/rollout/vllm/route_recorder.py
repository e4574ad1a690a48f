"""Records, in a vLLM worker, the experts each MoE router chose for every token of every request (R3).

vLLM 0.32 returns routed experts itself (`enable_return_routed_experts`) only under its Model Runner V2, which
its CPU build cannot run (V2 needs Triton); vLLM 0.23 (vllm-ascend's line) has it in its V1 runner, off by
default and not wired into lorarl. So lorarl records in the worker on every platform, two pieces:

    tap              each MoE layer's top-k ids of the forward's tokens          [tokens, k] per layer
    forward wrapper  the runner's `_model_forward`: which request owns which tokens (input_batch.req_ids,
                     query_start_loc) and at which positions (its `positions` argument, found by name:
                     vLLM 0.32 passes it by keyword; vllm-ascend 0.23's runner positionally, third)

and keeps, per vLLM request id, one row per position computed. `take` hands a request's rows over as a
lorarl.contract.routes array (positions never computed stay -1) and forgets them. A position computed twice
(a preempted request recomputed) keeps the later route. Prefix caching must be off while recording: a cached
position is never computed, so its route would be missing (the engine starts without it).

Where the ids come from differs by line (a `Tap`): vLLM's own MoE calls its router's capture hook
(`BaseRouter.set_capture_fn`, `router_tap` here; CPU CI runs it, tests/integration/rollout/test_vllm_moe.py);
vllm-ascend 0.23 selects experts in its own `select_experts`, past that hook (the router vLLM builds is never
called), so lorarl/rollout/vllm/npu_routes.py taps that call instead: written against vllm-ascend 0.23.0's source
and checked against it (surface.py), NOT run (no NPU here). A forward in which any layer's ids are missing or
cover fewer tokens than the batch is left unrecorded, with one warning per worker: the trainer routes those
positions live, as it does any position not recorded.

Memory is bounded: at most ``max_requests`` requests are kept; the oldest goes first (its routes then read as
not recorded). Only the first tensor-parallel rank records: without expert parallelism (lorarl never turns it
on) the router is replicated and every rank routes every token alike. Ids stay on the device until the forward
ends, then cross to the host once (one copy per forward, not per layer). The internals used are declared in
lorarl/rollout/vllm/surface.py.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUESTS = 8192

#: (MoE layer id as vLLM numbers it, `layer_id`; that layer's top-k expert ids of the forward's tokens [tokens, k])
Capture = Callable[[int, torch.Tensor], None]
#: Arranges for `Capture` to be called with every MoE layer's selection in each forward; returns the layer ids it
#: covers (router_tap here, npu_routes.ascend_tap on vllm-ascend).
Tap = Callable[[torch.nn.Module, Capture], list[int]]


def moe_layers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(layer id, module) of every MoE layer, in layer order, each id once: the modules with a `layer_id` and a
    router taking a capture hook (vLLM 0.32's MoERunner, vLLM 0.23's FusedMoE and so vllm-ascend's AscendFusedMoE).
    A LoRA wrapper holds its layer as `base_layer` and is not one itself."""
    found: dict[int, Any] = {}
    for module in model.modules():
        router = getattr(module, "router", None)
        if router is not None and callable(getattr(router, "set_capture_fn", None)) and hasattr(module, "layer_id"):
            found.setdefault(int(module.layer_id), module)
    return sorted(found.items(), key=lambda item: item[0])


def router_tap(model: torch.nn.Module, capture: Capture) -> list[int]:
    """vLLM's own MoE (CPU, CUDA): each router hands its logical top-k ids to its capture hook."""
    layers = moe_layers(model)
    for layer_id, module in layers:
        module.router.set_capture_fn(lambda ids, layer_id=layer_id: capture(layer_id, ids))
    return [layer_id for layer_id, _ in layers]


def positions_argument(forward: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """Reads `positions` from a `_model_forward` call, by keyword (vLLM 0.32's runner passes it so) or else at
    its place in the runner's own signature: vLLM's takes (input_ids, positions, ...), vllm-ascend 0.23's
    NPUModelRunner (num_tokens_padded, input_ids, positions, ...) and is called positionally."""
    names = list(inspect.signature(forward).parameters)
    if "positions" not in names:
        raise RuntimeError(f"the runner's _model_forward takes no 'positions' ({names}): cannot record routes")
    index = names.index("positions")

    def positions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if "positions" in kwargs:
            return kwargs["positions"]
        return args[index] if len(args) > index else None

    return positions


def graph_warning(runner: Any) -> str | None:
    """What recording misses when the runner replays CUDA/ACL graphs (None: it runs eagerly, as on CPU): a replay
    runs the captured kernels without Python, so no tap sees its forward."""
    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    name = getattr(mode, "name", str(mode))
    if mode is None or name == "NONE":
        return None
    return (f"recording routes with graphs on ({name}): a replayed graph runs the MoE layers without their tap, so "
            "the forwards it serves (decode steps) stay unrecorded and the trainer routes them live; set "
            "rollout.enforce_eager: true to record every forward")


class RouteRecorder:
    """Installed once per worker (`install`); `take` per finished request."""

    def __init__(self, layer_ids: Sequence[int], top_k: int, num_experts: int,
                 max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        self.layer_ids = list(layer_ids)
        self.layers, self.top_k, self.num_experts = len(self.layer_ids), top_k, num_experts
        self.max_requests = max_requests
        #: inside a recorded forward: layer id -> its ids (still on the device); None outside one
        self._step: dict[int, torch.Tensor] | None = None
        #: request id -> {position: [layers, top_k] int16}
        self._requests: OrderedDict[str, dict[int, np.ndarray]] = OrderedDict()
        self.evicted = 0
        self.silent_warned = False

    @classmethod
    def install(cls, runner: Any, model: torch.nn.Module, num_experts: int, top_k: int,
                max_requests: int = DEFAULT_MAX_REQUESTS, tap: Tap = router_tap) -> RouteRecorder:
        """Records every MoE layer of ``model`` (moe_layers) through ``tap``, per request of ``runner``."""
        layer_ids = [layer_id for layer_id, _ in moe_layers(model)]
        if not layer_ids:
            raise RuntimeError("no MoE layer with a capture hook (BaseRouter.set_capture_fn) in the served model: "
                               "this vLLM cannot record routes")
        recorder = cls(layer_ids, top_k, num_experts, max_requests)
        untapped = sorted(set(layer_ids) - set(tap(model, recorder.capture)))
        if untapped:
            raise RuntimeError(f"MoE layers {untapped} cannot be tapped: their routes would never be recorded")
        recorder._wrap_forward(runner)
        return recorder

    def _wrap_forward(self, runner: Any) -> None:
        forward = runner._model_forward
        positions = positions_argument(forward)

        def recorded_forward(*args: Any, **kwargs: Any) -> Any:
            self._step = {}
            try:
                out = forward(*args, **kwargs)
            finally:
                step, self._step = self._step, None
            self._assign(runner, positions(args, kwargs), step)
            return out

        runner._model_forward = recorded_forward

    def capture(self, layer_id: int, ids: torch.Tensor) -> None:
        """A tap's sink; outside a recorded forward (a drafter's, a warm-up's) it keeps nothing. A copy: the
        kernel after the selection may reuse the tensor."""
        if self._step is not None:
            self._step[layer_id] = ids.detach().clone()

    def _unusable(self, step: dict[int, torch.Tensor], total: int) -> dict[str, list[int]]:
        """Layers whose ids cannot be filed: never captured, fewer rows than the batch's tokens (an expert-parallel
        token shard), or not top_k wide."""
        problems: dict[str, list[int]] = {}
        for layer_id in self.layer_ids:
            ids = step.get(layer_id)
            problem = ("no capture" if ids is None else
                       "not [tokens, top_k]" if ids.dim() != 2 or ids.shape[1] != self.top_k else
                       f"fewer rows than the batch's {total} tokens" if ids.shape[0] < total else "")
            if problem:
                problems.setdefault(problem, []).append(layer_id)
        return problems

    def _assign(self, runner: Any, positions: torch.Tensor | None, step: dict[int, torch.Tensor]) -> None:
        """Files this forward's captured rows under the requests that own its tokens."""
        batch = runner.input_batch
        count = int(batch.num_reqs)
        if count == 0 or positions is None:
            return  # a dummy run (profiling, warm-up)
        starts = np.asarray(runner.query_start_loc.np[: count + 1], dtype=np.int64)
        total = int(starts[-1])
        problems = self._unusable(step, total)
        if problems:
            if not self.silent_warned:
                self.silent_warned = True
                logger.warning("recording routes: %d of %d MoE layers gave no usable experts in a forward of %d "
                               "requests (%s); its positions stay unrecorded and the trainer routes them live "
                               "(warned once)", sum(len(v) for v in problems.values()), self.layers, count,
                               "; ".join(f"{why}: layers {ids}" for why, ids in problems.items()))
            return
        rows = torch.stack([step[layer_id][:total] for layer_id in self.layer_ids], dim=1)
        step_ids = rows.to("cpu").to(torch.int16).numpy()  # [tokens, layers, k]: one copy to the host
        pos = positions.detach().to("cpu").reshape(-1)[:total].numpy()
        for req_id, begin, end in zip(batch.req_ids[:count], starts[:-1], starts[1:], strict=True):
            request_rows = self._requests.get(req_id)
            if request_rows is None:
                request_rows = self._requests[req_id] = {}
                if len(self._requests) > self.max_requests:
                    self._requests.popitem(last=False)
                    self.evicted += 1
            for t in range(int(begin), int(end)):
                request_rows[int(pos[t])] = step_ids[t].copy()  # a view would keep the whole step's array

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
