"""A manifest must agree with its job: PEFT names on catalog modules, LoRA shapes, merged shapes and dtypes."""

from __future__ import annotations

import pytest
import torch

from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.peft import parse_tensor_name
from lorarl.v1 import common_pb2
from lorarl.weightsync.wire.catalog import JobCatalog
from tests.unit.weightsync.fixtures import FINGERPRINT, adapter, base_weights, catalog, lora_spec, manifest_of

MERGED = common_pb2.SYNC_MODE_MERGED


def spec(targets: tuple[str, ...] = ("all-linear",), expert_mode: int = 0) -> JobCatalog:
    lora = lora_spec(targets=targets)
    lora.expert_mode = expert_mode
    return JobCatalog("job", FINGERPRINT, lora, catalog())


def refusal(tensors: dict[str, torch.Tensor], job: JobCatalog | None = None, mode: int = common_pb2.SYNC_MODE_ADAPTER
            ) -> InvalidArgumentError:
    manifest, _ = manifest_of(tensors, mode=mode)
    with pytest.raises(InvalidArgumentError) as info:
        (job or spec()).check(manifest)
    return info.value


def test_peft_names_parse() -> None:
    assert parse_tensor_name("base_model.model.a.b.q_proj.lora_A.weight") == ("a.b.q_proj", "A")
    assert parse_tensor_name("base_model.model.x.lora_B.weight") == ("x", "B")
    assert parse_tensor_name("a.b.q_proj.weight") is None


def test_valid_adapter_and_merged_pass() -> None:
    spec().check(manifest_of(adapter())[0])
    spec().check(manifest_of(base_weights(), mode=MERGED)[0])
    spec(("q_proj", "down_proj")).check(manifest_of(adapter())[0])


def test_adapter_shape_must_follow_rank_and_base() -> None:
    tensors = adapter()
    tensors["base_model.model.layers.0.q_proj.lora_A.weight"] = torch.zeros(4, 17)
    err = refusal(tensors)
    assert err.field and err.field.startswith("manifest.tensors[")
    assert "[4, 17] != [4, 16]" in err.message


def test_adapter_of_wrong_rank_is_refused() -> None:
    err = refusal(adapter(rank=8))
    assert "rank 4" in err.message


def test_adapter_on_unknown_or_non_target_module_is_refused() -> None:
    tensors = adapter()
    tensors["base_model.model.layers.9.q_proj.lora_A.weight"] = torch.zeros(4, 16)
    assert "no 2-D base weight layers.9.q_proj.weight" in refusal(tensors).message
    assert "not a target" in refusal(adapter(), spec(("q_proj",))).message
    lm_head = adapter(modules=("lm_head",))
    assert "not a target" in refusal(lm_head).message  # all-linear excludes the output layer


def test_adapter_needs_both_halves_and_peft_names() -> None:
    tensors = adapter()
    del tensors["base_model.model.layers.0.down_proj.lora_B.weight"]
    err = refusal(tensors)
    assert err.field == "manifest.tensors" and "lora_B is missing" in err.message
    assert "not an adapter tensor" in refusal({"layers.0.q_proj.weight": torch.zeros(32, 16)}).message


def test_adapter_dtype_must_be_float() -> None:
    tensors = adapter()
    tensors["base_model.model.layers.0.q_proj.lora_A.weight"] = torch.zeros(4, 16, dtype=torch.int32)
    assert "float32, bfloat16 or float16" in refusal(tensors).message


def test_expert_adapters_refused_when_expert_mode_none() -> None:
    catalog_ = catalog()
    catalog_.tensors.add(name="mlp.experts.0.gate_proj.weight", shape=[8, 16], dtype=common_pb2.D_TYPE_FLOAT32)
    lora = lora_spec()
    lora.expert_mode = common_pb2.EXPERT_ADAPTER_MODE_NONE
    job = JobCatalog("job", FINGERPRINT, lora, catalog_)
    tensors = {"base_model.model.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(4, 16),
               "base_model.model.mlp.experts.0.gate_proj.lora_B.weight": torch.zeros(8, 4)}
    assert "not a target" in refusal(tensors, job).message
    lora.expert_mode = common_pb2.EXPERT_ADAPTER_MODE_PER_EXPERT
    JobCatalog("job", FINGERPRINT, lora, catalog_).check(manifest_of(tensors)[0])


def test_merged_tensors_must_be_catalog_tensors_with_same_shape_and_dtype() -> None:
    assert "not a tensor of the base model catalog" in refusal({"nope.weight": torch.zeros(2)}, mode=MERGED).message
    wrong_shape = {"layers.0.q_proj.weight": torch.zeros(16, 32, dtype=torch.bfloat16)}
    assert "shape [16, 32] != catalog [32, 16]" in refusal(wrong_shape, mode=MERGED).message
    wrong_dtype = {"layers.0.q_proj.weight": torch.zeros(32, 16)}
    assert "D_TYPE_FLOAT32 != catalog D_TYPE_BFLOAT16" in refusal(wrong_dtype, mode=MERGED).message
