"""The one module that touches vLLM internals: a worker extension for in-memory adapters and weights.

vLLM has no public API to load a LoRA adapter from tensors (RFC vllm#48297), and AsyncLLM runs its
engine core in a child process, so tensors cannot simply be handed over. vLLM does offer
`parallel_config.worker_extension_cls`: methods of this class are mixed into the worker class and
reachable with `AsyncLLM.collective_rpc(name, kwargs=...)`. Payloads cross the process boundary as
safetensors *bytes* (msgpack carries bytes natively, it does not rebuild tensors in utility calls),
so nothing touches the disk.

Adapters: `lorarl_put_adapter` keeps (PEFT config, bytes) in a per-process registry and patches the
worker's LoRA manager so a `LoRARequest` whose path starts with MEMORY_SCHEME is built from the
registry (PEFTHelper.from_dict -> LoRAModel.from_lora_tensors, as AReaL does) instead of read from
a directory, and adds it to the worker in the same call. Everything else stays public:
`AsyncLLM.remove_lora` drops the adapter, and vLLM may evict and later reload it (after a weight
reload, say) without us: each build
deserialises fresh tensors, because vLLM folds the scale into lora_B in place.

Merged weights: `lorarl_put_weights` stages bytes while the engine keeps generating; between steps,
`lorarl_load_weights` feeds them to the worker's `reload_weights` (in place, checkpoint names).

Internals used (checked by `lorarl_probe`; tests/unit/rollout/test_vllm_internals.py fails loudly
when an upgrade moves them): worker.model_runner.lora_manager and its `_load_adapter`,
`_adapter_manager` (.model, .supported_lora_modules, .packed_modules_mapping), `lora_config`,
`vocab_size`, `max_position_embeddings`, `_lora_model_cls`; Worker.reload_weights(weights_iterator=).

CPU speed-ups (`lorarl_install_cpu_fixes`): the torch bgmv ops PunicaWrapperCPU calls are replaced by
grouped ones, and each CPU punica wrapper (`_adapter_manager.punica_wrapper_mapping`) gets a lean
`add_lora_linear` fed by a per-step plan built in its `update_metadata` (from `token_lora_indices`,
`is_prefill`, `no_lora`; the LoRA layers' stacked weights are [slots, 1, r, in] / [slots, 1, out, r]).
Both deliberately differ from vLLM CPU on one point: a token with adapter index -1 (a base-model
request) gets no LoRA delta, as vLLM's GPU kernels and its own metadata ("-1 means no lora") intend.
vLLM's torch ops index ``stacked[-1]`` instead, i.e. the last adapter slot, whenever some other token
of the step has an adapter, so a base-model request batched with adapter requests silently gets the
delta of whatever the last slot holds (a resident adapter, or an evicted one's stale weights). The
prefill shortcut (`no_lora`: no token of the step has an adapter, nothing is applied) is unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

MEMORY_SCHEME = "lorarl-mem://"
EXTENSION_QUALNAME = "services.rollout.vllm_worker_ext.LorarlWorkerExtension"

#: lora_int_id -> (PEFT adapter_config dict, safetensors bytes); one registry per worker process.
_ADAPTERS: dict[int, tuple[dict[str, Any], bytes]] = {}
#: staging token -> safetensors byte blobs of merged weights awaiting `lorarl_load_weights`.
_WEIGHTS: dict[str, list[bytes]] = {}

_LORA_MANAGER_ATTRS = ("_load_adapter", "_adapter_manager", "lora_config", "vocab_size",
                       "max_position_embeddings", "_lora_model_cls")


def _tensors(blob: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    return load(blob)


def _lora_manager(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("the engine was started without enable_lora: no LoRA manager on the worker")
    return manager


def _expected_modules(manager: Any) -> set[str]:
    """Leaf module names vLLM accepts in an adapter (as WorkerLoRAManager._load_adapter computes them)."""
    adapter_manager = manager._adapter_manager
    packed = adapter_manager.packed_modules_mapping
    expected: set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        expected.update(packed.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def _build_lora(manager: Any, lora_int_id: int) -> Any:
    """A LoRAModel for a registered adapter, from freshly deserialised tensors."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    config, blob = _ADAPTERS[lora_int_id]
    peft_helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft_helper.validate_legal(manager.lora_config)
    tensors = _tensors(blob)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    expected = _expected_modules(manager)
    unexpected = sorted({
        module for name in tensors
        if (module := parse_fine_tuned_lora_name(name, mapper)[0].rsplit(".", 1)[-1]) not in expected
    })
    if unexpected:
        raise ValueError(f"adapter targets modules this model cannot adapt: {unexpected} "
                         f"(supported: {sorted(expected)})")
    return manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_int_id, tensors=tensors, peft_helper=peft_helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


def _install_memory_loader(manager: Any) -> None:
    """Routes MEMORY_SCHEME requests of this manager to the registry; other paths keep vLLM's loader."""
    if getattr(manager, "_lorarl_installed", False):
        return
    original = manager._load_adapter

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        if not str(lora_request.lora_path).startswith(MEMORY_SCHEME):
            return original(lora_request)
        if lora_request.lora_int_id not in _ADAPTERS:
            raise RuntimeError(f"adapter {lora_request.lora_name} (id {lora_request.lora_int_id}) is not registered")
        return _build_lora(self, lora_request.lora_int_id)

    manager._load_adapter = types.MethodType(_load_adapter, manager)
    manager._lorarl_installed = True


def _staged_weights(token: str) -> Iterator[tuple[str, Any]]:
    for blob in _WEIGHTS.get(token, []):
        yield from _tensors(blob).items()


def _refresh_tied_lm_head(model: Any) -> bool:
    """Re-derives a tied lm_head's kernel state from the reloaded embedding.

    The checkpoint has no lm_head tensor when embeddings are tied, so the reload skips the layer
    ("ParallelLMHead: Failed to load weights") and, on CPU, its prepacked GEMM weight stays the old
    one although the shared tensor changed. Re-running its post-load processing repacks it.
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None or embed is None or weight.data_ptr() != embed.weight.data_ptr():
        return False
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(lm_head)
    return True


def _repack_cpu_moe_experts(model: Any) -> int:
    """Prepacks reloaded MoE expert weights again for vLLM's CPU grouped-GEMM kernel.

    On a weight update the unquantized MoE method copies the new (unpacked) weights into the
    existing storage and skips the experts' prepack, which only runs on first load, so the CPU
    kernel would read unpacked bytes as packed ones (wrong outputs, no error). Returns layers fixed.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    fixed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
            raise NotImplementedError("in-place reload of padded CPU MoE experts is not supported; restart the engine")
        experts.process_weights_after_loading(module)
        fixed += 1
    return fixed


def _rewind_cpu_generators(runner: Any) -> None:
    """vLLM rewinds a seeded request's generator when it discards the token sampled for a partial
    (chunked) prefill: ``gen.set_offset(gen.get_offset() - 4)``, a Philox (CUDA) notion. A CPU
    generator has no offset, so the first seeded request whose prompt is chunked kills the engine
    ("CPU Generator does not use offset"). Instead, the state of those requests' generators is saved
    just before the step samples and put back after it; the rewind itself is skipped by hiding them
    from that one bookkeeping call. Their tokens are still discarded, and a seeded request samples the
    same tokens however its prompt was chunked, which depends on what else the engine was running."""
    original_sample, original_bookkeeping = runner._sample, runner._bookkeeping_sync

    def discarded_generators() -> dict[int, Any]:
        batch = runner.input_batch
        discarded = runner.discard_request_mask.np[: batch.num_reqs].nonzero()[0]
        return {int(i): batch.generators[int(i)] for i in discarded if int(i) in batch.generators}

    def sample(*args: Any, **kwargs: Any) -> Any:
        runner._lorarl_generator_states = {i: g.get_state() for i, g in discarded_generators().items()}
        return original_sample(*args, **kwargs)

    def bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        hidden = {i: batch.generators.pop(i) for i in discarded_generators()}
        try:
            return original_bookkeeping(*args, **kwargs)
        finally:
            batch.generators.update(hidden)
            states, runner._lorarl_generator_states = runner._lorarl_generator_states, {}
            for i, state in states.items():
                if i in hidden:
                    hidden[i].set_state(state)

    runner._lorarl_generator_states = {}
    runner._sample, runner._bookkeeping_sync = sample, bookkeeping_sync


def _grouped_lora_matmul(inputs: Any, weights: Any, indices: Any, dtype: Any) -> Any:
    """``einsum("bi,boi->bo", inputs, weights[indices])`` without materialising one weight matrix per
    token: one matmul per distinct adapter index (a batch usually holds one or two). Rows with index -1
    (no adapter) come out zero, where vLLM's CPU ops would read the last slot (see module docstring)."""
    if weights.dim() == 4:
        weights = weights.squeeze(dim=1)
    inputs = inputs.to(dtype=dtype)
    distinct = indices.unique()
    if distinct.numel() == 1 and int(distinct[0]) >= 0:
        return inputs @ weights[int(distinct[0])].to(dtype=dtype).T
    out = inputs.new_zeros(inputs.shape[0], weights.shape[1])
    for index in distinct.tolist():
        if index < 0:
            continue
        rows = indices == index
        out[rows] = inputs[rows] @ weights[index].to(dtype=dtype).T
    return out


def _bgmv_shrink(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                 scaling: float = 1.0) -> None:
    outputs = _grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def _bgmv_expand(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                 add_inputs: bool = True) -> None:
    outputs = _grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def _bgmv_expand_slice(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                       slice_offset: int, slice_size: int, add_inputs: bool = True) -> None:
    outputs = _grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


#: vLLM's own bgmv ops per patched module, saved on first install so they can be put back.
_VLLM_CPU_LORA_OPS: dict[str, tuple[Any, Any, Any]] = {}


def _install_grouped_cpu_lora_ops(enabled: bool = True) -> None:
    """vLLM's CPU LoRA ops (vllm.lora.ops.torch_ops, used by PunicaWrapperCPU) gather a full
    [out, rank] matrix per token and contract them one by one; for the tiny demo model that made
    generation with an adapter ~4x slower than the base model. Ours do one matmul per adapter present
    in the batch, with vLLM's results on rows that have an adapter, and treat index -1 as no adapter
    (zero shrink rows, nothing added by expand) where the originals read the last slot: a vLLM CPU bug
    that leaks an adapter into base-model requests (module docstring). Process-wide (module
    attributes); ``enabled=False`` restores vLLM's ops (parity tests)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        originals = _VLLM_CPU_LORA_OPS.setdefault(
            module.__name__, (module.bgmv_shrink, module.bgmv_expand, module.bgmv_expand_slice))
        ops = (_bgmv_shrink, _bgmv_expand, _bgmv_expand_slice) if enabled else originals
        module.bgmv_shrink, module.bgmv_expand, module.bgmv_expand_slice = ops


#: A lean-path group: (adapter slot, never -1: rows without an adapter have no group; rows: None for
#: all, a slice for a contiguous run, or an index tensor).
_Group = tuple[int, Any]


class _LeanPlan:
    """Which rows use which adapter slot in the current step, computed once per mapping change
    (``update_metadata``) instead of per layer: vLLM re-derives it in every LoRA layer call."""

    __slots__ = ("groups", "tokens")

    def __init__(self, tokens: int, groups: tuple[_Group, ...]) -> None:
        self.tokens = tokens
        self.groups = groups


class _LeanWeights:
    """One layer's LoRA weights laid out for two matmuls per slot: A of all slices stacked and
    transposed [in, sum r] (shrink dtype), B block-diagonal and transposed [sum r, sum out] (output
    dtype); None for a slot whose A or B is all zero (its delta is exactly zero). Valid while the
    stacked tensors' version counters are unchanged (vLLM writes a slot in place with copy_)."""

    __slots__ = ("a", "b", "dtypes", "slots", "versions")

    def __init__(self, a: tuple[Any, ...], b: tuple[Any, ...], versions: tuple[int, ...],
                 dtypes: tuple[Any, Any]) -> None:
        self.a = a
        self.b = b
        self.versions = versions
        self.dtypes = dtypes
        self.slots: dict[int, tuple[Any, Any] | None] = {}

    def slot(self, slot: int) -> tuple[Any, Any] | None:
        if slot not in self.slots:
            import torch

            shrink_dtype, out_dtype = self.dtypes
            a = torch.cat([t[slot, 0].to(shrink_dtype) for t in self.a])
            b = torch.block_diag(*(t[slot, 0].to(out_dtype) for t in self.b))
            self.slots[slot] = (a.T, b.T) if bool(a.any()) and bool(b.any()) else None
        return self.slots[slot]


def _lean_plan(wrapper: Any) -> _LeanPlan:
    """The step's row groups, one per adapter slot present. Rows with index -1 (no adapter) get no
    group, so no delta: deliberately not vLLM CPU's semantics, whose torch ops read the last slot for
    them (a bug, see the module docstring). When the prefill metadata says no token has an adapter
    (``no_lora``) the plan is empty straight away, as vLLM's prefill shortcut is."""
    import torch

    indices = wrapper.token_lora_indices
    tokens = int(indices.numel())
    if tokens == 0 or (wrapper.is_prefill and wrapper.no_lora):
        return _LeanPlan(tokens, ())
    slots = indices.unique()
    if slots.numel() == 1:
        slot = int(slots[0])
        return _LeanPlan(tokens, ((slot, None),) if slot >= 0 else ())
    groups: list[_Group] = []
    for slot in slots.tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(indices == slot).squeeze(1)
        start, stop = int(rows[0]), int(rows[-1]) + 1
        groups.append((slot, slice(start, stop) if stop - start == rows.numel() else rows))
    return _LeanPlan(tokens, tuple(groups))


def _lean_layer(wrapper: Any, lora_a_stacked: tuple[Any, ...], lora_b_stacked: tuple[Any, ...],
                output_slices: tuple[int, ...], dtypes: tuple[Any, Any]) -> _LeanWeights | None:
    """The layer's cached weights, rebuilt when vLLM has written them; None for a layout other than
    vLLM 0.32's linear LoRA layers ([slots, 1, r, in] / [slots, 1, out, r] per output slice)."""
    cache: dict[int, _LeanWeights] = wrapper._lorarl_lean_weights
    try:
        versions = tuple(t._version for t in lora_a_stacked) + tuple(t._version for t in lora_b_stacked)
    except RuntimeError:  # inference tensors have no version counter: no safe cache
        return None
    entry = cache.get(id(lora_a_stacked))
    if entry is not None and entry.a is lora_a_stacked and entry.versions == versions and entry.dtypes == dtypes:
        return entry
    if not len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices) or any(
            a.dim() != 4 or a.shape[1] != 1 or b.dim() != 4 or b.shape[1] != 1 or b.shape[2] != width
            or a.shape[2] != b.shape[3] or a.shape[0] != b.shape[0]
            for a, b, width in zip(lora_a_stacked, lora_b_stacked, output_slices, strict=True)):
        return None
    entry = cache[id(lora_a_stacked)] = _LeanWeights(lora_a_stacked, lora_b_stacked, versions, dtypes)
    wrapper._lorarl_lean_builds += 1
    return entry


def _lean_add_lora_linear(wrapper: Any, y: Any, x: Any, lora_a_stacked: tuple[Any, ...],
                          lora_b_stacked: tuple[Any, ...], scale: float, output_slices: tuple[int, ...],
                          *, buffer: Any = None, **kwargs: Any) -> None:
    """``PunicaWrapperCPU.add_lora_linear`` in two matmuls per adapter slot present (shrink of all
    slices at once, block-diagonal expand added in place into ``y``) instead of ~5 torch ops per slice
    plus per-call index work. vLLM's results on rows with an adapter (shrink in the fp32 buffer dtype,
    expand in ``y``'s dtype); rows with index -1 are left untouched (see _lean_plan). Anything unusual
    (a caller's buffer or extra kwargs, no plan yet, other shapes, torch.compile tracing, which would
    freeze the plan into the graph) takes vLLM's own method, which treats -1 as no adapter only on
    the grouped ops (installed alongside by default)."""
    import torch

    plan: _LeanPlan | None = wrapper._lorarl_lean_plan
    y2 = y.view(-1, y.shape[-1])
    x2 = x.view(-1, x.shape[-1])
    layer = None
    if (buffer is None and not kwargs and plan is not None and plan.tokens == x2.shape[0] == y2.shape[0]
            and sum(output_slices) == y2.shape[1] and not torch.compiler.is_compiling()):
        # fp32 is vLLM's default shrink buffer dtype ("consistent with the triton op")
        layer = _lean_layer(wrapper, lora_a_stacked, lora_b_stacked, output_slices, (torch.float32, y2.dtype))
    if layer is None:
        return type(wrapper).add_lora_linear(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                             buffer=buffer, **kwargs)
    assert plan is not None
    for slot, rows in plan.groups:
        weights = layer.slot(slot)
        if weights is None:
            continue
        a_t, b_t = weights
        contiguous = rows is None or isinstance(rows, slice)
        x_rows = x2 if rows is None else x2[rows] if contiguous else x2.index_select(0, rows)
        shrunk = torch.mm(x_rows.to(torch.float32), a_t)
        if scale != 1.0:
            shrunk = scale * shrunk
        shrunk = shrunk.to(y2.dtype)
        if not contiguous:
            y2.index_add_(0, rows, torch.mm(shrunk, b_t))
        elif y2.dtype == torch.float32:  # one fused op, bitwise what mm + add gives in fp32
            (y2 if rows is None else y2[rows]).addmm_(shrunk, b_t)
        else:  # in bf16/fp16 addmm_ rounds once where vLLM's ops round the product, then the sum
            (y2 if rows is None else y2[rows]).add_(torch.mm(shrunk, b_t))
    return None


def _lean_update_metadata(wrapper: Any, *args: Any, **kwargs: Any) -> None:
    type(wrapper).update_metadata(wrapper, *args, **kwargs)
    wrapper._lorarl_lean_plan = _lean_plan(wrapper)


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _cpu_punica_wrappers(runner: Any) -> list[Any]:
    """The worker's CPU punica wrappers (one per language model / tower / connector)."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    manager = getattr(runner, "lora_manager", None)
    mapping = getattr(getattr(manager, "_adapter_manager", None), "punica_wrapper_mapping", None) or {}
    unique = {id(w): w for w in mapping.values() if isinstance(w, PunicaWrapperCPU)}
    return list(unique.values())


def _set_lean_lora(wrapper: Any, enabled: bool) -> None:
    """Turns the lean LoRA path on or off for one CPU punica wrapper. Instance attributes, so other
    engines in the process keep theirs; the plan starts from the wrapper's current metadata."""
    if enabled:
        ready = wrapper.indices_len[0] is not None  # metadata of the last step, if any
        wrapper._lorarl_lean_plan = _lean_plan(wrapper) if ready else None
        wrapper._lorarl_lean_weights = {}
        wrapper._lorarl_lean_builds = 0
        wrapper.update_metadata = types.MethodType(_lean_update_metadata, wrapper)
        wrapper.add_lora_linear = types.MethodType(_lean_add_lora_linear, wrapper)
    else:
        for attr in ("update_metadata", "add_lora_linear", "_lorarl_lean_plan", "_lorarl_lean_weights",
                     "_lorarl_lean_builds"):
            wrapper.__dict__.pop(attr, None)


class LorarlWorkerExtension:
    """Mixed into vLLM's worker class (see module docstring); every method runs in the worker process."""

    def lorarl_probe(self) -> dict[str, bool]:
        """Which internals this module relies on are present (for the upgrade canary test)."""
        found: dict[str, bool] = {"reload_weights": callable(getattr(self, "reload_weights", None))}
        runner = getattr(self, "model_runner", None)
        found["model_runner._bookkeeping_sync"] = callable(getattr(runner, "_bookkeeping_sync", None))
        found["model_runner._sample"] = callable(getattr(runner, "_sample", None))
        found["model_runner.discard_request_mask"] = hasattr(getattr(runner, "discard_request_mask", None), "np")
        found["model_runner.input_batch.generators"] = isinstance(
            getattr(getattr(runner, "input_batch", None), "generators", None), dict)
        manager = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        found["lora_manager"] = manager is not None
        if manager is not None:
            for attr in _LORA_MANAGER_ATTRS:
                found[f"lora_manager.{attr}"] = hasattr(manager, attr)
            adapter_manager = getattr(manager, "_adapter_manager", None)
            for attr in ("model", "supported_lora_modules", "packed_modules_mapping", "punica_wrapper_mapping"):
                found[f"lora_manager._adapter_manager.{attr}"] = hasattr(adapter_manager, attr)
            wrappers = _cpu_punica_wrappers(runner)
            found["cpu punica wrappers"] = bool(wrappers) or not _is_cpu()
            for attr in ("token_lora_indices", "indices_len", "is_prefill", "no_lora", "update_metadata"):
                found[f"punica_wrapper.{attr}"] = all(hasattr(w, attr) for w in wrappers)
        return found

    def lorarl_install_cpu_fixes(self, lean_lora: bool = True, grouped_lora: bool = True) -> bool:
        """Works around vLLM CPU bugs and slow paths in this worker (see _rewind_cpu_generators,
        _install_grouped_cpu_lora_ops, _lean_add_lora_linear); idempotent. The two LoRA switches apply
        on every call, so benchmarks and parity tests can compare paths on one engine."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if not getattr(runner, "_lorarl_cpu_fixes", False):
            _rewind_cpu_generators(runner)
            runner._lorarl_cpu_fixes = True
        _install_grouped_cpu_lora_ops(grouped_lora)
        for wrapper in _cpu_punica_wrappers(runner):
            _set_lean_lora(wrapper, lean_lora)
        return True

    def lorarl_pin_cpus(self, cpus: list[int]) -> list[int]:
        """Pins every thread of this worker's process (vLLM's engine core, or the whole service when vLLM
        runs in-process) to ``cpus``; returns the union of the threads' CPU sets afterwards."""
        from services.common.cpu_affinity import pin_process

        return pin_process(cpus)

    def lorarl_lean_lora_state(self) -> dict[str, int]:
        """How much the lean LoRA path has served since switched on: CPU wrappers using it, layers
        whose weights it holds, and how often it (re)built a layer's weights (rises only when vLLM
        writes adapter slots, not per step)."""
        wrappers = [w for w in _cpu_punica_wrappers(self.model_runner)  # type: ignore[attr-defined]
                    if "add_lora_linear" in w.__dict__]
        return {"wrappers": len(wrappers), "layers": sum(len(w._lorarl_lean_weights) for w in wrappers),
                "builds": sum(w._lorarl_lean_builds for w in wrappers)}

    def lorarl_put_adapter(self, lora_int_id: int, peft_config: dict[str, Any], blob: bytes, lora_name: str,
                           lora_path: str) -> bool:
        """Registers an adapter and adds it to the worker as ``AsyncLLM.add_lora`` would (engine core and
        executor only forward that call), which builds it once through the memory loader: a bad one is
        refused here, not mid-request, in one trip to a busy engine instead of two."""
        from vllm.lora.request import LoRARequest

        if not lora_path.startswith(MEMORY_SCHEME):
            raise ValueError(f"lora_path must start with {MEMORY_SCHEME}, got {lora_path!r}")
        _install_memory_loader(_lora_manager(self))
        _ADAPTERS[lora_int_id] = (dict(peft_config), bytes(blob))
        try:
            self.add_lora(LoRARequest(lora_name=lora_name, lora_int_id=lora_int_id,  # type: ignore[attr-defined]
                                      lora_path=lora_path))
        except Exception:
            _ADAPTERS.pop(lora_int_id, None)
            raise
        return True

    def lorarl_drop_adapter(self, lora_int_id: int) -> bool:
        return _ADAPTERS.pop(lora_int_id, None) is not None

    def lorarl_put_weights(self, token: str, blob: bytes) -> int:
        """Adds one blob of merged weights to a staging area; returns the blobs staged so far."""
        _WEIGHTS.setdefault(token, []).append(bytes(blob))
        return len(_WEIGHTS[token])

    def lorarl_drop_weights(self, token: str) -> bool:
        return _WEIGHTS.pop(token, None) is not None

    def lorarl_load_weights(self, token: str) -> int:
        """Reloads the model in place from staged weights (call between steps, engine paused)."""
        if token not in _WEIGHTS:
            raise RuntimeError(f"no weights staged under {token!r}")
        try:
            count = 0

            def counted() -> Iterator[tuple[str, Any]]:
                nonlocal count
                for item in _staged_weights(token):
                    count += 1
                    yield item

            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)  # type: ignore[attr-defined]
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            _repack_cpu_moe_experts(model)
            _refresh_tied_lm_head(model)
            return count
        finally:
            _WEIGHTS.pop(token, None)
