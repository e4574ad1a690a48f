"""One rule for parameter names: which engine parameter each checkpoint tensor loads into, as the running
vLLM's own loader decides it. Runs in the worker process.

The names a trainer sends are the checkpoint's (`model.layers.0.self_attn.q_proj.weight`); the engine's
parameters are fused (`qkv_proj`, `gate_up_proj`, the experts' `w13_weight`/`w2_weight`), renamed by the
model's `hf_to_vllm_mapper`, and wrapped by LoRA (`qkv_proj.base_layer.weight`) — each vLLM line lays
them out its own way, and its loaders skip names they do not know without a word (vLLM 0.23's
Qwen3-MoE and dense loaders; a rotary buffer on any). So instead of a hand-kept mapping per version,
`weight_targets` runs the model's own `load_weights` once, at engine start, on shape-only (meta)
tensors, with every parameter's `weight_loader` replaced by a recorder that copies nothing: what it
records is exactly where each name would land. A name that lands nowhere is one the engine does not
load, and an update that sends it fails before anything is loaded (the rollout's policy manager).

vLLM 0.23's loaders look names up in `named_parameters()` and do not know LoRA's `.base_layer.`
(vLLM 0.32's forward through the wrapper themselves): the qkv and gate_up weights raise KeyError, the
o_proj and down_proj ones are skipped. `checkpoint_named_parameters` makes the model answer with the
names it had before LoRA wrapped it while such a loader runs; whether one does is found by trying
(`weight_targets` dry-runs both), not by version number.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

BASE_LAYER = ".base_layer."


def lora_wrapped(model: Any) -> bool:
    """Whether LoRA layers wrap any of the model's modules (an engine started with enable_lora)."""
    try:
        from vllm.lora.layers import BaseLayerWithLoRA
    except ImportError:
        return False
    return any(isinstance(m, BaseLayerWithLoRA) for m in model.modules())


UNWRAP_FLAG = "_lorarl_unwrap_names"
#: How loaders refuse a name they do not know (vLLM 0.23: KeyError; 0.32's AutoWeightsLoader: ValueError).
REFUSALS = (KeyError, ValueError, AttributeError)
#: The one "target" of a name whose dry run failed otherwise (a loader writing a parameter directly, which
#: a shape-only tensor cannot do): not provably skipped, so counted as loaded, and the engine logs it.
UNCHECKED = "?unchecked:"


def needs_unwrapped_names(model: Any) -> bool:
    """Whether this model's loader must see the unwrapped names, as `weight_targets` found by trying."""
    return bool(getattr(model, UNWRAP_FLAG, False))


@contextlib.contextmanager
def checkpoint_named_parameters(model: Any, enabled: bool = True) -> Iterator[None]:
    """While inside, every module's ``named_parameters`` yields names without ``.base_layer.`` (the same
    Parameter objects): a loader that looks checkpoint names up finds the wrapped layers' weights."""
    if not enabled:
        yield
        return
    patched = []
    for module in model.modules():
        original = module.named_parameters  # bound method of its class

        def unwrapped(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Iterator[tuple[str, Any]]:
            for name, param in _original(*args, **kwargs):
                yield name.replace(BASE_LAYER, "."), param

        module.named_parameters = types.MethodType(unwrapped, module)
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("named_parameters", None)


def weight_targets(model: Any, shapes: Mapping[str, tuple[str, Sequence[int]]]) -> dict[str, list[str]]:
    """{checkpoint name: the engine parameters the model's loader writes it into}, an empty list for a
    name it would skip (or refuses), ``[UNCHECKED + error]`` for one the dry run cannot settle. ``shapes``:
    {name: (dtype, shape)}. Nothing is copied (see module docstring).

    Under LoRA, where the loader as it is lands fewer names than with the unwrapped names (vLLM 0.23's
    loaders), the model is marked to be loaded with them from now on (`needs_unwrapped_names`)."""
    setattr(model, UNWRAP_FLAG, False)
    targets = _dry_run(model, shapes, unwrap=False)
    if lora_wrapped(model) and not all(targets.values()):
        unwrapped = _dry_run(model, shapes, unwrap=True)
        if sum(map(bool, unwrapped.values())) > sum(map(bool, targets.values())):
            setattr(model, UNWRAP_FLAG, True)
            return unwrapped
    return targets


def _dry_run(model: Any, shapes: Mapping[str, tuple[str, Sequence[int]]], unwrap: bool) -> dict[str, list[str]]:
    import torch

    params = dict(model.named_parameters(remove_duplicate=False))
    current: list[str] = [""]
    hits: dict[str, list[str]] = {name: [] for name in shapes}
    # Each parameter's attributes as they were: vLLM's own parameter classes keep the loader in ``_weight_loader``
    # behind a property, so restoring a ``weight_loader`` entry alone left the recorder in place on them (a later
    # load into such a parameter then copied nothing).
    saved: dict[int, tuple[Any, dict[str, Any]]] = {}
    for pname, param in params.items():
        if id(param) in saved:
            continue
        saved[id(param)] = (param, dict(param.__dict__))

        def record(*args: Any, _pname: str = pname, **kwargs: Any) -> bool:
            if _pname not in hits[current[0]]:
                hits[current[0]].append(_pname)
            return True  # the loaders that ask (experts) count it as loaded

        param.weight_loader = record

    def fed(names: Sequence[str]) -> Iterator[tuple[str, Any]]:
        for name in names:
            dtype, shape = shapes[name]
            current[0] = name
            yield name, torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta")

    try:
        with checkpoint_named_parameters(model, unwrap):
            try:
                model.load_weights(fed(list(shapes)))
            except Exception:  # a name the loader refuses: try each alone, a refused one lands nowhere
                for targets in hits.values():
                    targets.clear()
                for name in shapes:
                    try:
                        model.load_weights(fed([name]))
                    except REFUSALS:
                        hits[name].clear()  # the loader's word on a name it does not know: lands nowhere
                    except Exception as exc:  # the dry run itself cannot tell (a loader copying directly)
                        hits[name][:] = [f"{UNCHECKED}{type(exc).__name__}"]
    finally:
        for param, attributes in saved.values():
            param.__dict__.clear()
            param.__dict__.update(attributes)
    return hits
