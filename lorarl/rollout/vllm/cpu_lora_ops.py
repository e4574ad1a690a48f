"""The faster CPU LoRA path (installed by LorarlWorkerExtension.lorarl_install_cpu_fixes).

The torch bgmv ops PunicaWrapperCPU calls are replaced by
grouped ones, and each CPU punica wrapper (`_adapter_manager.punica_wrapper_mapping`) gets a lean
`add_lora_linear` fed by a per-step plan built in its `update_metadata` (from `token_lora_indices`,
`is_prefill`, `no_lora`; the LoRA layers' stacked weights are [slots, 1, r, in] / [slots, 1, out, r]).
Both deliberately differ from vLLM CPU on one point: a token with adapter index -1 (a base-model
request) gets no LoRA delta, as vLLM's GPU kernels and its own metadata ("-1 means no lora") intend.
vLLM's torch ops index ``stacked[-1]`` instead, i.e. the last adapter slot, whenever some other token
of the step has an adapter, so a base-model request batched with adapter requests silently gets the
delta of whatever the last slot holds (a resident adapter, or an evicted one's stale weights). The
prefill shortcut (`no_lora`: no token of the step has an adapter, nothing is applied) is unchanged.

Prompt logprobs. vLLM computes a request's prompt logprobs (`_get_prompt_logprobs_dict`) by running the LM
head over that one request's prompt rows, while the logits LoRA (`add_lora_logits`) indexes them with the
batch's per-*sequence* sampler indices: with more than one sequence in the step the shapes disagree (vLLM CPU
raises IndexError and its engine core dies: a Tinker `compute_logprobs` or the served-policy guard's probe
next to other requests), or, when the counts happen to match, rows get other sequences' adapters (the shape
of vLLM #51594). While prompt logprobs are computed (`_guard_prompt_logprobs` marks it) the logits LoRA adds
nothing when no loaded adapter has lm_head weights (exact: lorarl trains decoder linears only) and refuses
with a clear error when one does, instead of crashing or adding another sequence's delta.
"""

from __future__ import annotations

import types
from typing import Any


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


#: Set while the runner computes prompt logprobs (see the module docstring).
_IN_PROMPT_LOGPROBS = [False]


def _guard_prompt_logprobs(runner: Any) -> None:
    """Marks the runner's prompt-logprob computation for the logits LoRA ops below; idempotent."""
    if getattr(runner, "_lorarl_prompt_logprobs_guarded", False):
        return
    original = runner._get_prompt_logprobs_dict

    def guarded(*args: Any, **kwargs: Any) -> Any:
        _IN_PROMPT_LOGPROBS[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            _IN_PROMPT_LOGPROBS[0] = False

    runner._get_prompt_logprobs_dict = guarded
    runner._lorarl_prompt_logprobs_guarded = True


def _bgmv_shrink(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                 scaling: float = 1.0) -> None:
    if _IN_PROMPT_LOGPROBS[0]:  # the logits LoRA of prompt rows: see the module docstring
        output_tensor.zero_()
        return
    outputs = _grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def _bgmv_expand(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                 add_inputs: bool = True) -> None:
    if _IN_PROMPT_LOGPROBS[0]:
        if bool(lora_b_weights.any()):
            raise RuntimeError("prompt logprobs under an adapter with lm_head LoRA weights are not served on vLLM "
                               "CPU: its logits LoRA cannot tell a request's prompt rows apart (vLLM #51594)")
        return  # no loaded adapter adapts lm_head: its delta is exactly zero
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
