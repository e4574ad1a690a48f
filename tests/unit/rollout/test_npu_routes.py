"""Route capture on vllm-ascend 0.23 (lorarl/rollout/vllm/npu_routes.py), on CPU: stand-ins and the pinned source.

The tap is driven through the real RouteRecorder with stand-ins of vllm-ascend's MoE method, layer and runner
(tests/unit/rollout/ascend_moe.py; not the real classes, which need torch_npu): it must file the same rows the CPU
path's router hook does. Then the pinned vllm-ascend 0.23.0 / vLLM 0.23.0 source (tools/ascend_sources.py) is read
for every name, signature and call site the tap rests on, and a doctored copy of each shows the check failing,
so an upgrade that moves the expert selection fails CI instead of silently recording nothing. Not run on an NPU.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lorarl.rollout.vllm import compat, npu_routes, surface
from lorarl.rollout.vllm.route_recorder import RouteRecorder, graph_warning, router_tap
from lorarl.rollout.vllm.worker_ext import LorarlWorkerExtension
from tests.unit.rollout import ascend_moe
from tools import ascend_sources

MOE_LAYERS = [1, 3]  # a dense layer 0 and 2, as decoder_sparse_step models have
TOP_K, EXPERTS = 2, 8


class _Runner:
    """Stands in for a model runner: input_batch (req_ids, num_reqs) and query_start_loc.np filled per step as
    _prepare_inputs does, then `_model_forward` called positionally with the (padded) tokens."""

    def __init__(self, model: ascend_moe.MoEModel) -> None:
        self.model = model
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0)
        self.query_start_loc = SimpleNamespace(np=np.zeros(16, dtype=np.int32))
        self.compilation_config = SimpleNamespace(cudagraph_mode=SimpleNamespace(name="NONE"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, padded: int) -> None:
        raise NotImplementedError

    def step(self, scheduled: list[tuple[str, list[int], list[int]]], padded: int = 0) -> None:
        """One engine step: (request id, token ids, positions) of each request's tokens computed in it."""
        tokens = [t for _, ids, _ in scheduled for t in ids]
        positions = [p for _, _, pos in scheduled for p in pos]
        padded = max(padded, len(tokens))
        self.input_batch.req_ids = [r for r, _, _ in scheduled] + ["stale"]  # rows past num_reqs are not read
        self.input_batch.num_reqs = len(scheduled)
        self.query_start_loc.np[: len(scheduled) + 1] = np.cumsum([0, *(len(ids) for _, ids, _ in scheduled)])
        pad = padded - len(tokens)
        self.forward(torch.tensor(tokens + [0] * pad), torch.tensor(positions + [0] * pad), padded)


class NPURunner(_Runner):
    """NPUModelRunner: `_model_forward(num_tokens_padded, input_ids, positions, ...)` (model_runner_v1.py:2834)."""

    def _model_forward(self, num_tokens_padded: int, input_ids: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None, intermediate_tensors: Any = None,
                       inputs_embeds: Any = None, **model_kwargs: Any) -> torch.Tensor:
        return self.model(input_ids, positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, padded: int) -> None:
        self._model_forward(padded, input_ids, positions, None, None)


class VllmRunner(_Runner):
    """vLLM's GPUModelRunner: `_model_forward(input_ids, positions, ...)`."""

    def _model_forward(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                       intermediate_tensors: Any = None, inputs_embeds: Any = None, **model_kwargs: Any) -> Any:
        return self.model(input_ids, positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, padded: int) -> None:
        self._model_forward(input_ids, positions)


def _ascend(module: ModuleType, **model_kwargs: Any) -> tuple[ascend_moe.MoEModel, NPURunner, RouteRecorder]:
    model = ascend_moe.MoEModel(module.AscendFusedMoE, MOE_LAYERS, EXPERTS, TOP_K, **model_kwargs)
    runner = NPURunner(model)
    tap = functools.partial(npu_routes.tap_selection, module, module.AscendUnquantizedFusedMoEMethod)
    return model, runner, RouteRecorder.install(runner, model, EXPERTS, TOP_K, tap=tap)


def _routes(recorder: RouteRecorder, request_id: str) -> np.ndarray:
    fields = recorder.take(request_id)
    assert fields is not None and (fields["layers"], fields["top_k"]) == (len(MOE_LAYERS), TOP_K)
    return np.frombuffer(fields["data"], dtype=np.int16).reshape(fields["positions"], fields["layers"], TOP_K)


A_PROMPT, B_PROMPT = [5, 7, 9], [3, 4]


def _two_requests(runner: _Runner) -> None:
    """Prefill of two requests padded to a graph size of 8, a decode step of both, then a third request whose
    first two positions were not computed here (a recomputation starting mid-sequence)."""
    runner.step([("a", A_PROMPT, [0, 1, 2]), ("b", B_PROMPT, [0, 1])], padded=8)
    runner.step([("a", [11], [3]), ("b", [12], [2])], padded=4)
    runner.step([("c", [20, 21], [2, 3])])


@pytest.fixture
def fused_moe() -> ModuleType:
    return ascend_moe.load()


@pytest.mark.parametrize("lora", [False, True])
def test_the_ascend_tap_files_each_layers_experts_under_its_requests_positions(fused_moe: ModuleType,
                                                                                lora: bool) -> None:
    """Rows per request position in layer order, -1 where a position was never computed; padding tokens and
    the unused router are ignored; a LoRA wrapper does not count as a second layer."""
    model, runner, recorder = _ascend(fused_moe, lora=lora)
    assert recorder.layer_ids == MOE_LAYERS
    _two_requests(runner)
    np.testing.assert_array_equal(_routes(recorder, "a"), model.expected([*A_PROMPT, 11]).numpy())
    np.testing.assert_array_equal(_routes(recorder, "b"), model.expected([*B_PROMPT, 12]).numpy())
    c = _routes(recorder, "c")
    assert (c[:2] == -1).all()
    np.testing.assert_array_equal(c[2:], model.expected([20, 21]).numpy())
    assert recorder.take("a") is None and recorder.pending() == 0 and not recorder.silent_warned
    assert all(model.moe(i).router.capture_fn is None for i in range(len(MOE_LAYERS)))  # vLLM's hook: never set


def test_the_ascend_tap_and_vllms_router_hook_record_alike(fused_moe: ModuleType) -> None:
    """The same steps through vLLM's own MoE and router hook (router_tap, the path CPU CI runs end to end) and
    through the Ascend stand-ins give the same wire fields: one recorder contract on both lines."""
    _, npu_runner, npu_recorder = _ascend(fused_moe)
    model = ascend_moe.MoEModel(ascend_moe.VllmFusedMoE, MOE_LAYERS, EXPERTS, TOP_K)
    runner = VllmRunner(model)
    recorder = RouteRecorder.install(runner, model, EXPERTS, TOP_K, tap=router_tap)
    _two_requests(npu_runner)
    _two_requests(runner)
    for request_id in ("a", "b", "c"):
        assert npu_recorder.take(request_id) == recorder.take(request_id)


def test_only_the_selection_inside_apply_is_captured(fused_moe: ModuleType) -> None:
    """With multistream_overlap_gate, forward_impl selects once before apply does (fused_moe_0_23_0.py:456):
    that one has no layer and is not captured; nor is a selection outside any forward (warm-up, drafter)."""
    model, runner, recorder = _ascend(fused_moe)
    seen: list[tuple[int, tuple[int, ...]]] = []

    def capture(layer_id: int, ids: torch.Tensor) -> None:
        seen.append((layer_id, tuple(ids.shape)))
        recorder.capture(layer_id, ids)

    npu_routes.tap_selection(fused_moe, fused_moe.AscendUnquantizedFusedMoEMethod, model, capture)  # re-points it
    for i in range(len(MOE_LAYERS)):
        model.moe(i).overlap_gate = True
    runner.step([("a", A_PROMPT, [0, 1, 2])])
    assert seen == [(1, (3, TOP_K)), (3, (3, TOP_K))]
    fused_moe.select_experts(torch.zeros(2, 4), torch.zeros(2, EXPERTS), TOP_K, False, True)  # outside apply
    model(torch.tensor([1, 2]), torch.tensor([0, 1]))  # outside a recorded forward: kept nowhere
    assert len(seen) == 4 and recorder.pending() == 1
    np.testing.assert_array_equal(_routes(recorder, "a"), model.expected(A_PROMPT).numpy())


def test_an_expert_parallel_shard_shorter_than_the_batch_is_left_unrecorded(fused_moe: ModuleType,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Under MC2/all-to-all each TP rank selects for its tensor_split slice; rank 0's is the batch's first tokens.
    A padded decode batch fits in it and is recorded; a prefill longer than the slice is not, warned once."""
    model, runner, recorder = _ascend(fused_moe)
    for i in range(len(MOE_LAYERS)):
        model.moe(i).tp_shard = (0, 2)
    with caplog.at_level(logging.WARNING, logger="lorarl.rollout.vllm.route_recorder"):
        runner.step([("a", A_PROMPT, [0, 1, 2]), ("b", B_PROMPT, [0, 1])])  # 5 tokens, rank 0 selects for 3
        runner.step([("a", [11], [3]), ("b", [12], [2])], padded=4)  # 2 tokens in a slice of 2
        runner.step([("a", A_PROMPT, [0, 1, 2]), ("b", B_PROMPT, [0, 1])])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "2 of 2 MoE layers" in warnings[0] and "fewer rows than the batch's 5" in warnings[0]
    a = _routes(recorder, "a")
    assert (a[:3] == -1).all()
    np.testing.assert_array_equal(a[3], model.expected([11]).numpy()[0])


def test_a_layer_selecting_elsewhere_is_refused_and_nothing_is_patched(fused_moe: ModuleType) -> None:
    """A quantized method (or the 310P one, or a subclass overriding apply) selects in its own module: recording
    would find that layer empty in every forward, so install refuses, naming it, before patching anything."""
    model = ascend_moe.MoEModel(fused_moe.AscendFusedMoE, MOE_LAYERS, EXPERTS, TOP_K)
    model.moe(1).quant_method = fused_moe.OtherMoEMethod()
    apply, select = fused_moe.AscendUnquantizedFusedMoEMethod.apply, fused_moe.select_experts
    tap = functools.partial(npu_routes.tap_selection, fused_moe, fused_moe.AscendUnquantizedFusedMoEMethod)
    with pytest.raises(RuntimeError, match=r"MoE layers \[3\] select experts in \['OtherMoEMethod'\]"):
        RouteRecorder.install(NPURunner(model), model, EXPERTS, TOP_K, tap=tap)
    assert fused_moe.AscendUnquantizedFusedMoEMethod.apply is apply and fused_moe.select_experts is select

    class Overriding(fused_moe.AscendUnquantizedFusedMoEMethod):
        def apply(self, layer: Any, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return x

    model.moe(1).quant_method = Overriding()
    with pytest.raises(RuntimeError, match=r"\['Overriding'\]"):
        npu_routes.tap_selection(fused_moe, fused_moe.AscendUnquantizedFusedMoEMethod, model, lambda *a: None)


def test_tapping_twice_wraps_once_and_feeds_the_latest_recorder(fused_moe: ModuleType) -> None:
    original = fused_moe.AscendUnquantizedFusedMoEMethod.apply
    model, _, first = _ascend(fused_moe)
    tapped = fused_moe.AscendUnquantizedFusedMoEMethod.apply
    runner2 = NPURunner(model)
    tap = functools.partial(npu_routes.tap_selection, fused_moe, fused_moe.AscendUnquantizedFusedMoEMethod)
    second = RouteRecorder.install(runner2, model, EXPERTS, TOP_K, tap=tap)
    assert fused_moe.AscendUnquantizedFusedMoEMethod.apply is tapped and tapped.__wrapped__ is original
    runner2.step([("a", A_PROMPT, [0, 1, 2])])
    assert second.pending() == 1 and first.pending() == 0


def test_positions_are_read_where_each_runner_passes_them(fused_moe: ModuleType) -> None:
    """vllm-ascend passes positions third (after num_tokens_padded), vLLM second: read by name, not by index,
    or the NPU recorder would file routes under input ids. A runner without `positions` is refused."""
    model, runner, recorder = _ascend(fused_moe)
    runner.step([("a", [9, 9], [40, 41])])
    assert _routes(recorder, "a").shape[0] == 42  # positions 40 and 41, not the token ids 9

    class Runner:
        input_batch = query_start_loc = None

        def _model_forward(self, *args: Any) -> None: ...

    with pytest.raises(RuntimeError, match="takes no 'positions'"):
        RouteRecorder.install(Runner(), model, EXPERTS, TOP_K, tap=lambda m, c: MOE_LAYERS)


@pytest.mark.parametrize("device", ["npu", "cpu"])
def test_a_worker_records_through_its_platforms_tap(fused_moe: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                    device: str) -> None:
    """lorarl_record_routes, the worker start-up the engine calls: an NPU worker taps vllm-ascend's selection
    (the stand-in module served under the tapped module's name), another vLLM's router hook; only rank 0
    records, and graphs being replayed come back as a warning."""
    monkeypatch.setitem(sys.modules, fused_moe.__name__, fused_moe)
    monkeypatch.setattr(npu_routes, "TAPPED_MODULE", fused_moe.__name__)
    npu = device == "npu"
    model = ascend_moe.MoEModel(fused_moe.AscendFusedMoE if npu else fused_moe.VllmFusedMoE, MOE_LAYERS, EXPERTS,
                                TOP_K)
    runner = NPURunner(model) if npu else VllmRunner(model)
    runner.model_config = SimpleNamespace(get_num_experts=lambda: EXPERTS,  # type: ignore[attr-defined]
                                          hf_text_config=SimpleNamespace(num_experts_per_tok=TOP_K))
    runner.compilation_config.cudagraph_mode = SimpleNamespace(name="PIECEWISE" if npu else "NONE")
    workers = []
    for rank in (0, 1):
        worker = LorarlWorkerExtension()
        worker.rank, worker.device, worker.model_runner = rank, SimpleNamespace(type=device), runner  # type: ignore
        workers.append(worker)
    assert compat.route_tap(workers[0]) is (npu_routes.ascend_tap if npu else router_tap)
    dims = workers[0].lorarl_record_routes(max_requests=16)
    assert {k: dims[k] for k in ("layers", "top_k", "num_experts")} == {"layers": 2, "top_k": TOP_K,
                                                                         "num_experts": EXPERTS}
    assert ("rollout.enforce_eager: true" in dims["warning"]) if npu else "warning" not in dims
    assert workers[1].lorarl_record_routes(max_requests=16) == {} and workers[1].lorarl_take_routes(["a"]) == {}
    assert workers[0].lorarl_record_routes(max_requests=16) == dims  # installed once
    runner.step([("a", A_PROMPT, [0, 1, 2])], padded=4)
    taken = workers[0].lorarl_take_routes(["a", "unknown"])
    assert set(taken) == {"a"}
    ids = np.frombuffer(taken["a"]["data"], dtype=np.int16).reshape(3, len(MOE_LAYERS), TOP_K)
    np.testing.assert_array_equal(ids, model.expected(A_PROMPT).numpy())


def test_replayed_graphs_are_named_as_what_recording_misses() -> None:
    assert graph_warning(SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=None))) is None
    assert graph_warning(SimpleNamespace()) is None
    eager = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="NONE")))
    assert graph_warning(eager) is None
    graphs = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="PIECEWISE")))
    assert "rollout.enforce_eager: true" in (graph_warning(graphs) or "")


# ------------------------------------------------------------------------ the pinned 0.23.0 source


def _ascend_roots() -> list[Path]:
    roots = ascend_sources.roots()
    assert roots, "the Ascend release's source is not fetched: `make setup` fetches it (tools/ascend_sources.py)"
    return roots


#: What npu_routes.py and the recorder rest on in vllm-ascend 0.23.0 / vLLM 0.23.0 (declared in surface.py).
TAPPED = {
    "vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.apply",
    "vllm_ascend.ops.fused_moe.fused_moe:select_experts",
    "vllm_ascend.ops.fused_moe.experts_selector:select_experts",
    "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.quant_method",
    "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.layer_id",
    "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.router",
    "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.forward_impl",
    "vllm.model_executor.layers.fused_moe.layer:FusedMoE.router",
    "vllm.model_executor.layers.fused_moe.layer:FusedMoE.layer_id",
    "vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter.set_capture_fn",
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner._model_forward",
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner.input_batch",
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner.query_start_loc",
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner.compilation_config",
    "vllm_ascend.worker.npu_input_batch:NPUInputBatch.req_ids",
    "vllm_ascend.worker.npu_input_batch:NPUInputBatch.num_reqs",
}


def test_the_pinned_ascend_release_selects_experts_where_the_tap_wraps() -> None:
    roots = _ascend_roots()
    findings = {f.symbol.ref: f for f in surface.check_sources(roots, "npu")}
    assert set(findings) >= TAPPED
    assert [findings[ref].line() for ref in sorted(TAPPED) if not findings[ref].ok] == []
    calls = surface.check_calls(roots, "npu")
    assert [f.line() for f in calls] == [
        "ok       vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.forward_impl calls self.quant_method.apply",
        "ok       vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.apply calls select_experts"]
    # the tap patches exactly what is declared
    select = surface.CALL_SITES[-1]
    assert select.caller.ref == f"{npu_routes.TAPPED_MODULE}:{npu_routes.TAPPED_METHOD}.apply"
    assert select.callee == npu_routes.SELECT
    assert surface.check_calls(list(surface.installed_roots()), "cpu") == []  # vLLM's own line: the router hook


FUSED_MOE = Path("vllm_ascend/ops/fused_moe/fused_moe.py")
FUSED_MOE_0_23 = Path("vllm_ascend/ops/fused_moe/fused_moe_0_23_0.py")
RUNNER = Path("vllm_ascend/worker/model_runner_v1.py")
APPLY_CALL = "\n        topk_weights, topk_ids = select_experts(\n"


@pytest.mark.parametrize(("path", "old", "new", "ref", "problem"), [
    (FUSED_MOE, APPLY_CALL, "\n        topk_weights, topk_ids = experts_selector.select_experts(\n",
     "AscendUnquantizedFusedMoEMethod.apply calls select_experts", "no call of select_experts(...) in it"),
    (FUSED_MOE, APPLY_CALL, "\n        from vllm_ascend.ops.fused_moe.experts_selector import select_experts"
     + APPLY_CALL, "AscendUnquantizedFusedMoEMethod.apply calls select_experts", "is bound inside the function"),
    (FUSED_MOE, APPLY_CALL, "\n        routing = select_experts(\n",
     "AscendUnquantizedFusedMoEMethod.apply calls select_experts", "unpacked into 2 names"),
    (FUSED_MOE, "from vllm_ascend.ops.fused_moe.experts_selector import select_experts, zero_experts_compute",
     "from vllm_ascend.ops.fused_moe.experts_selector import zero_experts_compute",
     "AscendUnquantizedFusedMoEMethod.apply calls select_experts", "not bound at"),
    (FUSED_MOE_0_23, "self.quant_method.apply(\n            layer=self,", "self.quant_method.apply(\n            self,",
     "AscendFusedMoE.forward_impl calls self.quant_method.apply", "passes layer=self by keyword"),
    (FUSED_MOE, "    def apply(\n        self,\n        layer: torch.nn.Module,",
     "    def apply(\n        self,\n        moe_layer: torch.nn.Module,",
     "AscendUnquantizedFusedMoEMethod.apply", "does not take layer"),
    (RUNNER, "        positions: torch.Tensor | None = None,\n        intermediate_tensors",
     "        position_ids: torch.Tensor | None = None,\n        intermediate_tensors",
     "NPUModelRunner._model_forward", "does not take positions"),
], ids=["select-renamed", "select-shadowed", "select-not-unpacked", "select-not-imported", "layer-positional",
        "apply-layer-renamed", "runner-positions-renamed"])
def test_a_moved_selection_in_the_ascend_source_fails_the_check(tmp_path: Path, path: Path, old: str, new: str,
                                                                ref: str, problem: str) -> None:
    """Each thing the tap rests on, changed in a copy of the 0.23.0 file, is a blocking finding naming it."""
    roots = _ascend_roots()
    original = next(r / path for r in roots if (r / path).is_file())
    text = original.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    doctored = tmp_path / path
    doctored.parent.mkdir(parents=True)
    doctored.write_text(text.replace(old, new))
    checker = surface.Checker(surface.SourceTree([tmp_path, *roots]))
    declared = [*surface.needed("npu"), *surface.needed_calls("npu")]
    [finding] = [checker.find_call(d) if isinstance(d, surface.CallSite) else checker.find(d)
                 for d in declared if d.ref.split(":", 1)[1] == ref]
    assert surface.blocking([finding]) == [finding] and problem in finding.problem, finding.line()
