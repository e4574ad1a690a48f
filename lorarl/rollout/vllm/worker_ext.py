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
`lorarl_load_weights` reloads the model in place from them (compat.reload_weights: the worker's own
`reload_weights`, or vllm-ascend's layerwise sequence where the NPU worker has none).

Internals used are all declared in surface.py (checked against the installed vLLM and the pinned
Ascend release's source; `lorarl_probe` checks a live worker): worker.model_runner.lora_manager and
its `_load_adapter`, `_adapter_manager` (.model, .supported_lora_modules, .packed_modules_mapping),
`lora_config`, `vocab_size`, `max_position_embeddings`, `_lora_model_cls`. Calls whose form differs
between vLLM lines go through compat.py.

CPU code apart, each piece with its canary test: cpu_fixes.py (three vLLM CPU bugs worked around) and
cpu_lora_ops.py (the faster CPU LoRA path); `lorarl_install_cpu_fixes` switches them on.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

from lorarl.rollout.vllm import compat
from lorarl.rollout.vllm.cpu_fixes import _refresh_tied_lm_head, _repack_cpu_moe_experts, _rewind_cpu_generators
from lorarl.rollout.vllm.cpu_lora_ops import (
    _cpu_punica_wrappers,
    _guard_prompt_logprobs,
    _install_grouped_cpu_lora_ops,
    _is_cpu,
    _set_lean_lora,
)

MEMORY_SCHEME = "lorarl-mem://"
EXTENSION_QUALNAME = "lorarl.rollout.vllm.worker_ext.LorarlWorkerExtension"

#: lora_int_id -> (PEFT adapter_config dict, safetensors bytes or tensors received in this worker).
_ADAPTERS: dict[int, tuple[dict[str, Any], bytes | dict[str, Any]]] = {}
#: staging token -> safetensors byte blobs and received tensors of merged weights awaiting `lorarl_load_weights`.
_WEIGHTS: dict[str, list[bytes | dict[str, Any]]] = {}
#: receive token -> tensors this worker received and verified itself (lorarl_receive), until adopted.
_RECEIVED: dict[str, dict[str, Any]] = {}

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
    # fresh tensors per build: vLLM folds the scale into lora_B in place
    tensors = _tensors(blob) if isinstance(blob, bytes) else {k: v.clone() for k, v in blob.items()}
    model = manager._adapter_manager.model
    mapper = compat.rename_mapper(model)
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


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def _staged_weights(token: str) -> Iterator[tuple[str, Any]]:
    for blob in _WEIGHTS.get(token, []):
        yield from (_tensors(blob) if isinstance(blob, bytes) else blob).items()



class LorarlWorkerExtension:
    """Mixed into vLLM's worker class (see module docstring); every method runs in the worker process."""

    def lorarl_probe(self) -> dict[str, bool]:
        """Which internals this module relies on are present (for the upgrade canary test)."""
        found: dict[str, bool] = {"reload_weights": compat.can_reload(self)}
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
            _guard_prompt_logprobs(runner)
            runner._lorarl_cpu_fixes = True
        _install_grouped_cpu_lora_ops(grouped_lora)
        for wrapper in _cpu_punica_wrappers(runner):
            _set_lean_lora(wrapper, lean_lora)
        return True

    def lorarl_install_npu_fixes(self) -> dict[str, Any]:
        """At NPU worker start (lorarl/rollout/vllm/npu_fixes.py): expert parameters keep their loaders
        before the first reload. Returns the reload way this worker takes and how many loaders came back."""
        from lorarl.rollout.vllm import npu_fixes

        return {"reload_way": compat.reload_way(self), "loaders_restored": npu_fixes.install(compat.served_model(self))}

    def lorarl_record_routes(self, max_requests: int) -> dict[str, Any]:
        """Starts recording the experts every MoE layer chooses (route_recorder.py; on vllm-ascend through its
        own expert selection, npu_routes.py), on the first rank only (without expert parallelism every rank
        routes every token alike); its layers, top-k and experts, and what it will miss ("warning": graphs
        replayed), {} on other ranks."""
        from lorarl.rollout.vllm.route_recorder import RouteRecorder, graph_warning

        if getattr(self, "rank", 0) != 0:
            return {}
        runner = self.model_runner  # type: ignore[attr-defined]
        config = runner.model_config
        recorder = getattr(self, "_lorarl_routes", None)
        if recorder is None:
            recorder = RouteRecorder.install(runner, compat.served_model(self), config.get_num_experts(),
                                             int(config.hf_text_config.num_experts_per_tok), max_requests,
                                             tap=compat.route_tap(self))
            self._lorarl_routes = recorder
        warning = graph_warning(runner)
        return {"layers": recorder.layers, "top_k": recorder.top_k, "num_experts": recorder.num_experts,
                **({"warning": warning} if warning else {})}

    def lorarl_take_routes(self, request_ids: list[str]) -> dict[str, Any]:
        """Each finished request's routes (wire fields; absent: none recorded), forgotten here ({} off rank 0)."""
        recorder = getattr(self, "_lorarl_routes", None)
        if recorder is None:
            return {}
        taken = {r: recorder.take(r) for r in request_ids}
        return {r: routes for r, routes in taken.items() if routes is not None}

    def lorarl_forget_routes(self, request_ids: list[str]) -> int:
        """Drops aborted requests' routes; how many requests still hold some."""
        recorder = getattr(self, "_lorarl_routes", None)
        if recorder is None:
            return 0
        recorder.forget(request_ids)
        return recorder.pending()

    def lorarl_pin_cpus(self, cpus: list[int]) -> list[int]:
        """Pins every thread of this worker's process (vLLM's engine core, or the whole service when vLLM
        runs in-process) to ``cpus``; returns the union of the threads' CPU sets afterwards."""
        from lorarl.common.cpu_affinity import pin_process

        return pin_process(cpus)

    def lorarl_lean_lora_state(self) -> dict[str, int]:
        """How much the lean LoRA path has served since switched on: CPU wrappers using it, layers
        whose weights it holds, and how often it (re)built a layer's weights (rises only when vLLM
        writes adapter slots, not per step)."""
        wrappers = [w for w in _cpu_punica_wrappers(self.model_runner)  # type: ignore[attr-defined]
                    if "add_lora_linear" in w.__dict__]
        return {"wrappers": len(wrappers), "layers": sum(len(w._lorarl_lean_weights) for w in wrappers),
                "builds": sum(w._lorarl_lean_builds for w in wrappers)}

    def lorarl_receive(self, token: str, manifest: bytes, backend: str, master_address: str, master_port: int,
                       ranks: list[int], world_size: int, group_name: str, source_rank: int, timeout_s: float,
                       local_address: str | None, key: bytes | None) -> dict[str, tuple[str, list[int]]]:
        """Joins a weight-transfer group and receives a version straight into this worker's device: the
        service process keeps the control plane (rendezvous, reports, commit); the bytes skip it.
        Every bucket and tensor checksum and every bucket's MAC is checked as in the service's own
        receive (lorarl.weightsync.client.agent.verify_pieces, on a host copy of each piece); the tensors
        kept are views into the device buffers. ``ranks``: one per worker of the engine, this worker
        joining with ranks[its own rank]; each receives the full tensors and loads its shard from them.
        Returns {name: (dtype, shape)} for the service's checks."""
        import torch

        from lorarl.v1 import common_pb2
        from lorarl.weightsync.client.agent import verify_pieces
        from lorarl.weightsync.wire.collective import WeightTransferGroup
        from lorarl.weightsync.wire.payload import unpack_bucket

        worker = int(getattr(self, "rank", 0))
        if not 0 <= worker < len(ranks):
            raise ValueError(f"worker {worker} has no transfer rank: {len(ranks)} given ({ranks})")
        rank = ranks[worker]
        parsed = common_pb2.WeightManifest.FromString(manifest)
        device = getattr(self, "device", None) or torch.device("cpu")
        group = WeightTransferGroup(backend, master_address, master_port, rank, world_size, group_name,
                                    timeout_s=timeout_s, device=str(device), local_address=local_address)
        on_device: dict[int, Any] = {}
        try:
            host = verify_pieces(parsed, group.receive_pieces([b.nbytes for b in parsed.buckets], source_rank,
                                                              on_device), key=key)
        finally:
            group.close(wait=False)
        tensors = host if device.type == "cpu" else {
            name: t for i, buffer in on_device.items() for name, t in unpack_bucket(parsed, i, buffer, verify=False)}
        _RECEIVED[token] = tensors
        return {name: (str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()}

    def lorarl_drop_received(self, token: str) -> bool:
        return _RECEIVED.pop(token, None) is not None

    def lorarl_adopt_received(self, token: str, received: str) -> int:
        """Adds tensors received in this worker to the merged weights staged under ``token``."""
        tensors = _RECEIVED.pop(received)
        _WEIGHTS.setdefault(token, []).append(tensors)
        return len(tensors)

    def lorarl_put_adapter(self, lora_int_id: int, peft_config: dict[str, Any], blob: bytes | None, lora_name: str,
                           lora_path: str, received: str | None = None) -> bool:
        """Registers an adapter and adds it to the worker as ``AsyncLLM.add_lora`` would (engine core and
        executor only forward that call), which builds it once through the memory loader: a bad one is
        refused here, not mid-request, in one trip to a busy engine instead of two. ``received``: the
        adapter's tensors were received in this worker (lorarl_receive) instead of coming as ``blob``."""
        from vllm.lora.request import LoRARequest

        if not lora_path.startswith(MEMORY_SCHEME):
            raise ValueError(f"lora_path must start with {MEMORY_SCHEME}, got {lora_path!r}")
        _install_memory_loader(_lora_manager(self))
        _ADAPTERS[lora_int_id] = (dict(peft_config), _RECEIVED.pop(received) if received else bytes(blob or b""))
        try:
            self.add_lora(LoRARequest(lora_name=lora_name, lora_int_id=lora_int_id,  # type: ignore[attr-defined]
                                      lora_path=lora_path))
        except Exception:
            _ADAPTERS.pop(lora_int_id, None)
            raise
        return True

    def lorarl_drop_adapter(self, lora_int_id: int) -> bool:
        """Forgets an unloaded adapter's bytes, and hands the heap they and its LoRA tensors held back to the
        system (lorarl.common.malloc_arenas.trim_malloc): the engine core's memory stays flat version after
        version."""
        from lorarl.common.malloc_arenas import trim_malloc

        dropped = _ADAPTERS.pop(lora_int_id, None) is not None
        trim_malloc()
        return dropped

    def lorarl_put_weights(self, token: str, blob: bytes) -> int:
        """Adds one blob of merged weights to a staging area; returns the blobs staged so far."""
        _WEIGHTS.setdefault(token, []).append(bytes(blob))
        return len(_WEIGHTS[token])

    def lorarl_drop_weights(self, token: str) -> bool:
        return _WEIGHTS.pop(token, None) is not None

    def lorarl_weight_targets(self, shapes: dict[str, tuple[str, list[int]]]) -> dict[str, list[str]]:
        """Where the model's own loader would write each checkpoint tensor (weight_names.weight_targets)."""
        from lorarl.rollout.vllm.weight_names import weight_targets

        return weight_targets(compat.served_model(self), shapes)

    def lorarl_weights_digest(self) -> dict[str, str]:
        """sha256 of every model parameter as the worker holds it: two ways of loading the same weights
        (reload ways, in-worker receive) must leave identical bytes (parity tests, bench/npu_check.py)."""
        import hashlib

        model = compat.served_model(self)
        return {name: hashlib.sha256(p.detach().to("cpu").contiguous().view(-1).view(torch_uint8()).numpy()
                                     ).hexdigest()
                for name, p in model.named_parameters()}

    def lorarl_load_weights(self, token: str, way: str | None = None) -> int:
        """Reloads the model in place from staged weights (call between steps, engine paused); `way`
        forces one of compat.reload_weights' ways (parity tests), else the worker's own is taken."""
        if token not in _WEIGHTS:
            raise RuntimeError(f"no weights staged under {token!r}")
        try:
            count = 0

            def counted() -> Iterator[tuple[str, Any]]:
                nonlocal count
                for item in _staged_weights(token):
                    count += 1
                    yield item

            compat.reload_weights(self, counted(), way)
            model = compat.served_model(self)
            _repack_cpu_moe_experts(model)
            _refresh_tied_lm_head(model)
            return count
        finally:
            _WEIGHTS.pop(token, None)
