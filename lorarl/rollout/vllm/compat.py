"""The calls whose form differs between the vLLM lines lorarl runs on (0.32; vllm-ascend's 0.23.0).

Each function picks its way by what the running vLLM has (feature tests, not version numbers, so a
backport or a newer release takes the better way by itself); surface.py declares every symbol and
which of them may be missing, and tests check both lines' sources against it. The NPU ways follow
vllm-ascend's own RL weight update (NPUWorker.start/update/finish_weight_update in v0.23.0).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from lorarl.common import ascend

if TYPE_CHECKING:
    from lorarl.rollout.vllm.route_recorder import Tap


def platform_environment(device_type: str) -> dict[str, str]:
    """Environment a rollout sets before vLLM starts on this device: vllm-ascend's FRACTAL_NZ weight cast
    off (default 1), since a weight update into NZ-cast parameters loses precision and vllm-ascend
    refuses RL updates unless it is 0 (lorarl/common/ascend.py)."""
    return {ascend.NZ_ENV: ascend.NZ_FOR_RL} if device_type == "npu" else {}


def apply_platform_environment(device_type: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets `platform_environment` before the engine starts; refuses a conflicting value the user set."""
    for key, value in platform_environment(device_type).items():
        if environ.get(key, value) != value:
            raise ValueError(_nz_message(key, environ[key], value))
        environ[key] = value


def check_platform_environment(device_type: str, environ: Mapping[str, str] = os.environ) -> None:
    """Raises where the running engine was started without `platform_environment` (too late to set it)."""
    for key, value in platform_environment(device_type).items():
        if environ.get(key) != value:
            raise ValueError(_nz_message(key, environ.get(key, "unset (vllm-ascend's default: 1)"), value))


def _nz_message(key: str, current: str, value: str) -> str:
    return (f"{key} is {current}, but weight updates on Ascend need {key}={value}: vllm-ascend refuses RL weight "
            f"updates into FRACTAL_NZ-cast weights; start the rollout with {key}={value}")


def rename_mapper(model: Any) -> Any:
    """The weights mapper used to parse adapter tensor names, as the running vLLM's own loader does."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    get_rename = getattr(mapper, "get_rename_mapper", None)
    return get_rename() if callable(get_rename) else mapper  # vLLM < 0.32: the mapper as is


def enable_envs_cache() -> bool:
    """Freezes vLLM's environment reads once the engine is up, where vLLM can (0.32)."""
    from vllm import envs

    enable = getattr(envs, "enable_envs_cache", None)
    if callable(enable):
        enable()
        return True
    return False


def disable_envs_cache() -> bool:
    """Thaws what `enable_envs_cache` froze, before another engine starts in this process: it sets its own
    environment (the CPU thread binding), and a forked engine core inherits its parent's frozen reads."""
    from vllm import envs

    disable = getattr(envs, "disable_envs_cache", None)
    if callable(disable):
        disable()
        return True
    return False


async def set_weight_version(llm: Any, label: str) -> bool:
    """Tells vLLM the label of the weights it now serves, where it keeps one (0.24+); the rollout keeps
    its own version either way, so this is bookkeeping, not correctness."""
    update = getattr(llm, "update_weight_version", None)
    if callable(update):
        await update(label)
        return True
    return False


RELOAD_WAYS = ("worker", "per_tensor", "layerwise")


def reload_way(worker: Any) -> str:
    """'worker' where the worker reloads in place itself (vLLM 0.32, vLLM's GPU/CPU workers);
    'per_tensor' where it does not (vllm-ascend 0.23's NPUWorker): the way AReaL runs on 910B nodes.
    'layerwise' (vllm-ascend's own RL update sequence) is the other NPU candidate; bench/npu_check.py
    runs both on hardware and compares them."""
    return "worker" if callable(getattr(worker, "reload_weights", None)) else "per_tensor"


def can_reload(worker: Any) -> bool:
    """Whether `reload_weights` has a way on this worker (for the live probe)."""
    if reload_way(worker) == "worker":
        return True
    try:
        from vllm.model_executor.model_loader.reload import (  # noqa: F401
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return False
    return hasattr(getattr(worker, "model_runner", None), "model")


def reload_weights(worker: Any, weights: Iterable[tuple[str, Any]], way: str | None = None) -> None:
    """Reloads the model in place from checkpoint-named tensors (engine paused between steps).

    The layerwise way is what vLLM's reload_weights does inside and what vllm-ascend's NPUWorker
    runs for RL updates: vLLM records each layer's loaded form, puts the weights back into checkpoint
    layout, loads, and re-runs each layer's process_weights_after_loading. That is what undoes and
    redoes the NPU's transposed MoE expert weights (AscendUnquantizedFusedMoEMethod) around a reload.
    Under LoRA, loaders that do not know its `.base_layer.` names (vLLM 0.23's) see the unwrapped names
    (weight_names.checkpoint_named_parameters).
    """
    from lorarl.rollout.vllm.weight_names import checkpoint_named_parameters, needs_unwrapped_names

    way = way or reload_way(worker)
    if way not in RELOAD_WAYS:
        raise ValueError(f"unknown reload way {way!r}; one of {RELOAD_WAYS}")
    model = served_model(worker)
    with checkpoint_named_parameters(model, needs_unwrapped_names(model)):
        _reload(worker, weights, way)


def served_model(worker: Any) -> Any:
    """The model a worker serves: its runner's get_model() (vLLM's GPU and CPU runners), else its `model`
    (vllm-ascend 0.23's NPUModelRunner)."""
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def route_tap(worker: Any) -> Tap:
    """Where a worker's MoE layers hand over the experts they select (a route_recorder.Tap): vLLM's router
    capture hook, or on an NPU vllm-ascend's own expert selection, which never calls that router
    (npu_routes.py). By device: vllm-ascend is the only NPU line."""
    if _device_type(worker) == "npu":
        from lorarl.rollout.vllm.npu_routes import ascend_tap

        return ascend_tap
    from lorarl.rollout.vllm.route_recorder import router_tap

    return router_tap


def _reload(worker: Any, weights: Iterable[tuple[str, Any]], way: str) -> None:
    if way == "worker":
        worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return
    import torch

    device_type = _device_type(worker)
    check_platform_environment(device_type)
    runner = worker.model_runner
    model = runner.model
    with torch.device(worker.device) if getattr(worker, "device", None) is not None else contextlib.nullcontext():
        if way == "layerwise":
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            initialize_layerwise_reload(model)
            model.load_weights(_as_iterator(weights))
            finalize_layerwise_reload(model, worker.model_config)
        else:
            _per_tensor_reload(runner, model, weights, device_type)
    synchronize = getattr(getattr(torch, _device_type(worker), None), "synchronize", None)
    if callable(synchronize) and _device_type(worker) != "cpu":
        synchronize()  # collectives and copies on NPU/CUDA streams are asynchronous


def _per_tensor_reload(runner: Any, model: Any, weights: Iterable[tuple[str, Any]], device_type: str) -> None:
    """AReaL's NPU reload: experts back to loader layout, one load_weights per decoder layer (AReaL: per
    tensor), then every layer's process_weights_after_loading once (which re-transposes the experts)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from lorarl.rollout.vllm import npu_fixes

    if device_type == "npu":
        npu_fixes.undo_moe_expert_layout(model)  # the loaders were given back at worker start (install)
    with set_current_vllm_config(runner.vllm_config):
        for batch in npu_fixes.layer_batches(weights):
            model.load_weights(weights=batch)
        process_weights_after_loading(model, runner.model_config, runner.device)


def _as_iterator(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    yield from weights


def _device_type(worker: Any) -> str:
    device = getattr(worker, "device", None)
    return getattr(device, "type", None) or str(device or "cpu").split(":")[0]
