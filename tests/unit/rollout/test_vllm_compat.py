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
