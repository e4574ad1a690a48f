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
a directory. Everything else stays public: `AsyncLLM.add_lora` / `remove_lora` load and drop the
adapter, and vLLM may evict and later reload it (after a weight reload, say) without us: each build
deserialises fresh tensors, because vLLM folds the scale into lora_B in place.

Merged weights: `lorarl_put_weights` stages bytes while the engine keeps generating; between steps,
`lorarl_load_weights` feeds them to the worker's `reload_weights` (in place, checkpoint names).

Internals used (checked by `lorarl_probe`; tests/unit/rollout/test_vllm_internals.py fails loudly
when an upgrade moves them): worker.model_runner.lora_manager and its `_load_adapter`,
`_adapter_manager` (.model, .supported_lora_modules, .packed_modules_mapping), `lora_config`,
`vocab_size`, `max_position_embeddings`, `_lora_model_cls`; Worker.reload_weights(weights_iterator=).
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


def _skip_cpu_generator_rewind(runner: Any) -> None:
    """vLLM rewinds a seeded request's generator when it discards the token sampled for a partial
    (chunked) prefill: ``gen.set_offset(gen.get_offset() - 4)``, a Philox (CUDA) notion. A CPU
    generator has no offset, so the first seeded request whose prompt is chunked kills the engine
    ("CPU Generator does not use offset"). Hiding the discarded requests' generators from that one
    bookkeeping call skips the rewind; their tokens are still discarded, and seeded sampling stays
    deterministic for a given schedule (it only no longer ignores how the prompt was chunked)."""
    original = runner._bookkeeping_sync

    def bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        discarded = runner.discard_request_mask.np[: batch.num_reqs].nonzero()[0]
        hidden = {int(i): batch.generators.pop(int(i)) for i in discarded if int(i) in batch.generators}
        try:
            return original(*args, **kwargs)
        finally:
            batch.generators.update(hidden)

    runner._bookkeeping_sync = bookkeeping_sync


def _grouped_lora_matmul(inputs: Any, weights: Any, indices: Any, dtype: Any) -> Any:
    """``einsum("bi,boi->bo", inputs, weights[indices])`` without materialising one weight matrix per
    token: one matmul per distinct adapter index (a batch usually holds one or two)."""
    if weights.dim() == 4:
        weights = weights.squeeze(dim=1)
    inputs = inputs.to(dtype=dtype)
    distinct = indices.unique()
    if distinct.numel() == 1:
        return inputs @ weights[int(distinct[0])].to(dtype=dtype).T
    out = inputs.new_empty(inputs.shape[0], weights.shape[1])
    for index in distinct.tolist():
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


def _install_grouped_cpu_lora_ops() -> None:
    """vLLM's CPU LoRA ops (vllm.lora.ops.torch_ops, used by PunicaWrapperCPU) gather a full
    [out, rank] matrix per token and contract them one by one; for the tiny demo model that made
    generation with an adapter ~4x slower than the base model. Same semantics (including index -1,
    which reads the last slot as the originals do), one matmul per adapter present in the batch."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink = _bgmv_shrink
        module.bgmv_expand = _bgmv_expand
        module.bgmv_expand_slice = _bgmv_expand_slice


class LorarlWorkerExtension:
    """Mixed into vLLM's worker class (see module docstring); every method runs in the worker process."""

    def lorarl_probe(self) -> dict[str, bool]:
        """Which internals this module relies on are present (for the upgrade canary test)."""
        found: dict[str, bool] = {"reload_weights": callable(getattr(self, "reload_weights", None))}
        runner = getattr(self, "model_runner", None)
        found["model_runner._bookkeeping_sync"] = callable(getattr(runner, "_bookkeeping_sync", None))
        found["model_runner.discard_request_mask"] = hasattr(getattr(runner, "discard_request_mask", None), "np")
        found["model_runner.input_batch.generators"] = isinstance(
            getattr(getattr(runner, "input_batch", None), "generators", None), dict)
        manager = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        found["lora_manager"] = manager is not None
        if manager is not None:
            for attr in _LORA_MANAGER_ATTRS:
                found[f"lora_manager.{attr}"] = hasattr(manager, attr)
            adapter_manager = getattr(manager, "_adapter_manager", None)
            for attr in ("model", "supported_lora_modules", "packed_modules_mapping"):
                found[f"lora_manager._adapter_manager.{attr}"] = hasattr(adapter_manager, attr)
        return found

    def lorarl_install_cpu_fixes(self) -> bool:
        """Works around vLLM CPU bugs in this worker (see _skip_cpu_generator_rewind); idempotent."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if not getattr(runner, "_lorarl_cpu_fixes", False):
            _skip_cpu_generator_rewind(runner)
            _install_grouped_cpu_lora_ops()
            runner._lorarl_cpu_fixes = True
        return True

    def lorarl_put_adapter(self, lora_int_id: int, peft_config: dict[str, Any], blob: bytes) -> bool:
        """Registers an adapter and builds it once, so a bad one is refused here and not mid-request."""
        manager = _lora_manager(self)
        _install_memory_loader(manager)
        _ADAPTERS[lora_int_id] = (dict(peft_config), bytes(blob))
        try:
            _build_lora(manager, lora_int_id)
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
