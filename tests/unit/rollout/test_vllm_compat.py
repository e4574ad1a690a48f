"""compat.py's choices between vLLM lines, and npu_fixes.py's expert-layout arithmetic, on stand-ins.

The live ways are tested on a real CPU engine (tests/integration/rollout/test_vllm_dense.py: the worker's
reload and the layerwise one serve the same tokens); what needs an NPU is checked by bench/npu_check.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from lorarl.rollout.vllm import compat, npu_fixes


def test_npu_rollouts_start_with_nz_off_and_refuse_a_user_setting_that_breaks_updates() -> None:
    env: dict[str, str] = {}
    compat.apply_platform_environment("npu", env)
    assert env == {"VLLM_ASCEND_ENABLE_NZ": "0"}
    compat.check_platform_environment("npu", env)
    with pytest.raises(ValueError, match=r"VLLM_ASCEND_ENABLE_NZ is 2.*VLLM_ASCEND_ENABLE_NZ=0"):
        compat.apply_platform_environment("npu", {"VLLM_ASCEND_ENABLE_NZ": "2"})
    with pytest.raises(ValueError, match=r"unset .vllm-ascend's default: 1"):
        compat.check_platform_environment("npu", {})
    cpu_env: dict[str, str] = {"VLLM_ASCEND_ENABLE_NZ": "1"}
    compat.apply_platform_environment("cpu", cpu_env)
    compat.check_platform_environment("cuda", {})
    assert cpu_env == {"VLLM_ASCEND_ENABLE_NZ": "1"}


def test_the_rename_mapper_and_the_weight_version_fall_back_where_vllm_lacks_them() -> None:
    class NewMapper:
        def get_rename_mapper(self) -> str:
            return "renames only"

    old = object()
    assert compat.rename_mapper(SimpleNamespace(hf_to_vllm_mapper=NewMapper())) == "renames only"
    assert compat.rename_mapper(SimpleNamespace(hf_to_vllm_mapper=old)) is old
    assert compat.rename_mapper(SimpleNamespace()) is None

    seen: list[str] = []

    class NewLLM:
        async def update_weight_version(self, label: str) -> None:
            seen.append(label)

    assert asyncio.run(compat.set_weight_version(NewLLM(), "v3")) and seen == ["v3"]
    assert not asyncio.run(compat.set_weight_version(object(), "v4"))


def test_a_worker_without_reload_weights_takes_the_per_tensor_way() -> None:
    class Worker:
        def reload_weights(self, **kwargs: object) -> None: ...

    assert compat.reload_way(Worker()) == "worker"
    assert compat.reload_way(object()) == "per_tensor"
    with pytest.raises(ValueError, match="unknown reload way 'fast'"):
        compat.reload_weights(Worker(), [], way="fast")


def test_npu_expert_weights_go_back_to_loader_layout_and_keep_their_loader() -> None:
    experts = torch.nn.Module()
    experts.w13_weight = torch.nn.Parameter(torch.arange(24.).reshape(2, 3, 4), requires_grad=False)
    experts.w2_weight = torch.nn.Parameter(torch.arange(24.).reshape(2, 4, 3), requires_grad=False)
    experts.other = torch.nn.Parameter(torch.zeros(2, 3, 4), requires_grad=False)
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = experts
    before = experts.w13_weight.detach().clone()
    assert npu_fixes.undo_moe_expert_layout(model) == 2
    assert experts.w13_weight.shape == (2, 4, 3) and experts.w2_weight.shape == (2, 3, 4)
    assert experts.other.shape == (2, 3, 4)
    torch.testing.assert_close(experts.w13_weight.transpose(1, 2), before, rtol=0, atol=0)

    class AscendMethod:  # stands in for AscendUnquantizedFusedMoEMethod (re-creates the parameters)
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.w13_weight = torch.nn.Parameter(layer.w13_weight.data.transpose(1, 2).contiguous(),
                                                  requires_grad=False)
            layer.w2_weight = torch.nn.Parameter(layer.w2_weight.data.transpose(1, 2).contiguous(),
                                                 requires_grad=False)

    def loader(*args: object) -> None: ...

    experts.weight_loader = loader
    assert npu_fixes.keep_moe_weight_loaders(AscendMethod) and not npu_fixes.keep_moe_weight_loaders(AscendMethod)
    AscendMethod().process_weights_after_loading(experts)
    assert experts.w13_weight.weight_loader is loader and experts.w2_weight.weight_loader is loader
    torch.testing.assert_close(experts.w13_weight, before, rtol=0, atol=0)  # round trip: the NPU layout again


class _Wrapper(torch.nn.Module):
    """Stands in for vLLM's LoRA wrapper: holds the layer as base_layer and forwards attributes to it."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base_layer"], name)


def _experts() -> torch.nn.Module:
    experts = torch.nn.Module()
    experts.w13_weight = torch.nn.Parameter(torch.arange(24.).reshape(2, 3, 4), requires_grad=False)
    experts.w2_weight = torch.nn.Parameter(torch.arange(24.).reshape(2, 4, 3), requires_grad=False)
    return experts


def test_a_lora_wrapped_expert_layer_is_transposed_once_and_gets_its_loaders_back() -> None:
    """With LoRA on, the experts are reachable as `.experts.base_layer.w13_weight` and through the
    wrapper's attribute forwarding: each parameter still goes back to loader layout exactly once; the
    loaders vllm-ascend dropped at engine start are restored at worker start (install), not at the
    first reload."""
    experts = _experts()
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = _Wrapper(experts)
    assert model.mlp.experts.w13_weight is experts.w13_weight  # the forwarding that made the old match fragile
    assert [n for n, _ in model.named_parameters()] == ["mlp.experts.base_layer.w13_weight",
                                                        "mlp.experts.base_layer.w2_weight"]
    before = experts.w13_weight.detach().clone()
    assert npu_fixes.expert_layers(model) == [experts]
    assert npu_fixes.undo_moe_expert_layout(model) == 2
    torch.testing.assert_close(experts.w13_weight, before.transpose(1, 2), rtol=0, atol=0)

    def loader(*args: object) -> None: ...

    experts.weight_loader = loader
    assert npu_fixes.restore_weight_loaders(model) == 2
    assert experts.w13_weight.weight_loader is loader and experts.w2_weight.weight_loader is loader
    assert npu_fixes.restore_weight_loaders(model) == 0  # idempotent


def test_a_reload_loads_a_decoder_layer_per_call() -> None:
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.0.w",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.10.mlp.gate.weight", "model.norm.weight",
             "lm_head.weight"]
    batches = [[n for n, _ in b] for b in npu_fixes.layer_batches((n, None) for n in names)]
    assert batches == [["model.embed_tokens.weight"],
                       ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.0.w"],
                       ["model.layers.1.self_attn.q_proj.weight"], ["model.layers.10.mlp.gate.weight"],
                       ["model.norm.weight"], ["lm_head.weight"]]
    assert list(npu_fixes.layer_batches([])) == []
