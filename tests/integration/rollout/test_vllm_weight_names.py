"""One rule for parameter names (lorarl/rollout/vllm/weight_names.py), held on live vLLM CPU engines.

Checkpoints that carry a tensor the engine's loader skips without a word (an old checkpoint's rotary
buffer in the dense model; a router bias the Qwen3-MoE loader ignores by suffix): the engine starts,
says which names it does not load, and a merged update naming one fails the version with
FAILED_PRECONDITION naming the tensor, the previous version serving on. Then vLLM 0.23's own dense
loader (the one vllm-ascend 0.23 runs, read from the pinned source) put into a LoRA-enabled engine: as
it is, it loads none of the LoRA-wrapped weights (KeyError for the fused ones, a silent skip for the
rest); with the rule it lands every name, and a merged reload through it serves the HF merge.
"""

from __future__ import annotations

import ast
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.vllm import engine as vllm_engine
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import (
    RolloutHarness,
    generate,
    greedy,
    load_requests,
    merged_weights,
    reference_greedy,
)
from tests.support import vllm_worker
from tests.unit.rollout.models import LORA, PROMPT, dense_model_dir, moe_model_dir, random_adapter
from tools import ascend_sources

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MERGED = common_pb2.SYNC_MODE_MERGED
N_TOKENS = 16
ROTARY = "model.layers.0.self_attn.rotary_emb.inv_freq"
ROUTER_BIAS = "model.layers.0.mlp.gate.bias"


def with_extra_tensor(source: Path, target: Path, name: str, tensor: torch.Tensor) -> Path:
    """A copy of a model whose checkpoint also holds ``name``."""
    shutil.copytree(source, target)
    [file] = sorted(target.glob("*.safetensors"))
    weights = load_file(file)
    weights[name] = tensor
    save_file(weights, str(file), metadata={"format": "pt"})
    return target


def started(model_dir: Path, **kwargs: object) -> RolloutHarness:
    return RolloutHarness(RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="float32",
                                          max_model_len=256, kv_cache_gib=0.25, **kwargs)).start()


def load_merged(service: RolloutHarness, job: str, version: int, tensors: dict, fingerprint: str) -> None:
    service.stub.LoadWeights(load_requests(job, version, tensors, MERGED, fingerprint, None), timeout=120)


def refused(service: RolloutHarness, job: str, tensors: dict, fingerprint: str, name: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        load_merged(service, job, 2, tensors, fingerprint)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert repr(name) in info.value.details() and "would not be loaded" in info.value.details()


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RolloutHarness, Path]]:
    model_dir = with_extra_tensor(dense_model_dir(), tmp_path_factory.mktemp("dense") / "model", ROTARY,
                                  torch.arange(8, dtype=torch.float32))
    with pytest.MonkeyPatch.context() as patch:  # a worker extension that can swap the model's loader
        patch.setattr(vllm_engine, "EXTENSION_QUALNAME", vllm_worker.QUALNAME)
        service = started(model_dir, enable_lora=True)
    yield service, model_dir
    service.close()


def test_the_rule_maps_checkpoint_names_to_the_wrapped_fused_parameters(dense) -> None:
    service, model_dir = dense
    engine = service.core.engine
    files = ModelFiles(model_dir)
    assert engine.loaded_weight_names == frozenset(files.weight_names()) - {ROTARY}
    shapes = {n: ("float32", list(files.shape(n))) for n in ("model.layers.0.self_attn.k_proj.weight",
                                                             "model.layers.1.mlp.down_proj.weight", ROTARY)}
    targets = service.call(engine.llm.collective_rpc("lorarl_weight_targets", kwargs={"shapes": shapes}))[0]
    assert targets == {"model.layers.0.self_attn.k_proj.weight": [
                           "model.layers.0.self_attn.qkv_proj.base_layer.weight"],
                       "model.layers.1.mlp.down_proj.weight": ["model.layers.1.mlp.down_proj.base_layer.weight"],
                       ROTARY: []}


def test_a_merged_update_naming_a_tensor_the_loader_skips_fails_naming_it(dense) -> None:
    service, model_dir = dense
    fingerprint = base_model_fingerprint(model_dir)
    adapter = random_adapter(dense_model_dir(), seed=5)
    reference = reference_greedy(dense_model_dir(), PROMPT, N_TOKENS, adapter, LORA)
    merged = merged_weights(model_dir, adapter, LORA)
    assert ROTARY in merged  # the checkpoint's own names, the skipped one among them
    first = {n: t for n, t in merged.items() if n != ROTARY}
    load_merged(service, "names", 1, first, fingerprint)
    assert list(generate(service.stub, PROMPT, greedy(N_TOKENS), "names").token_ids) == reference[0]
    refused(service, "names", merged, fingerprint, ROTARY)
    served = generate(service.stub, PROMPT, greedy(N_TOKENS), "names")
    assert list(served.token_ids) == reference[0] and list(served.token_versions) == [1] * N_TOKENS
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="names"))


def _vllm_023_dense_loader() -> str:
    roots = ascend_sources.roots()
    assert roots, "the pinned vLLM 0.23 source is not fetched: `make setup` fetches it (tools/ascend_sources.py)"
    source = (roots[0] / "vllm" / "model_executor" / "models" / "qwen2.py").read_text()
    [cls] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Qwen2Model"]
    [fn] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights"]
    return textwrap.dedent(ast.get_source_segment(source, fn) or "")


def test_vllm_023s_loader_lands_every_name_under_lora_with_the_rule(dense) -> None:
    service, model_dir = dense
    engine = service.core.engine
    files = ModelFiles(model_dir)
    names = [n for n in files.weight_names() if n != ROTARY]
    shapes = {n: ("float32", list(files.shape(n))) for n in names}
    wrapped = {n for n in names if n.endswith(("_proj.weight", "embed_tokens.weight"))}
    rpc = engine.llm.collective_rpc
    installed = service.call(rpc("lorarl_test_install_loader", kwargs={"source": _vllm_023_dense_loader()}))
    assert installed == ["Qwen3Model"]
    try:
        as_is = service.call(rpc("lorarl_test_dry_run", kwargs={"shapes": shapes, "unwrap": False}))[0]
        assert {n for n, t in as_is.items() if t} == set(names) - wrapped  # every LoRA-wrapped weight lost
        targets = service.call(engine.llm.collective_rpc("lorarl_weight_targets", kwargs={"shapes": shapes}))[0]
        assert all(targets.values()), [n for n, t in targets.items() if not t]
        adapter = random_adapter(dense_model_dir(), seed=6)
        merged = {n: t for n, t in merged_weights(model_dir, adapter, LORA).items() if n != ROTARY}
        service.call(engine.stage_weights("v023", merged.items()))
        service.call(engine.llm.collective_rpc("lorarl_load_weights", kwargs={"token": "v023", "way": "layerwise"}))
        service.call(engine.reset_prefix_cache())
        served = generate(service.stub, PROMPT, greedy(N_TOKENS))  # a base request: the core loaded nothing
        assert list(served.token_ids) == reference_greedy(dense_model_dir(), PROMPT, N_TOKENS, adapter, LORA)[0]
    finally:
        service.call(rpc("lorarl_test_install_loader", kwargs={"source": None}))
        base = {n: t for n, t in load_file(next(model_dir.glob("*.safetensors"))).items() if n != ROTARY}
        service.call(engine.llm.collective_rpc("lorarl_weight_targets", kwargs={"shapes": shapes}))
        service.call(engine.stage_weights("base", base.items()))
        service.call(engine.llm.collective_rpc("lorarl_load_weights", kwargs={"token": "base"}))
        service.call(engine.reset_prefix_cache())
    assert list(generate(service.stub, PROMPT, greedy(N_TOKENS)).token_ids) == reference_greedy(
        dense_model_dir(), PROMPT, N_TOKENS)[0]


def test_the_moe_loaders_silent_skip_fails_the_version(tmp_path: Path) -> None:
    files = ModelFiles(moe_model_dir())
    experts = files.shape("model.layers.0.mlp.gate.weight")[0]  # type: ignore[index]
    model_dir = with_extra_tensor(moe_model_dir(), tmp_path / "moe", ROUTER_BIAS, torch.zeros(experts))
    service = started(model_dir)
    try:
        fingerprint = base_model_fingerprint(model_dir)
        assert ROUTER_BIAS not in service.core.engine.loaded_weight_names
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in service.core.engine.loaded_weight_names
        base = {n: t for n, t in load_file(next(model_dir.glob("*.safetensors"))).items()}
        reference = generate(service.stub, PROMPT, greedy(N_TOKENS))
        load_merged(service, "moe", 1, {n: t for n, t in base.items() if n != ROUTER_BIAS}, fingerprint)
        refused(service, "moe", base, fingerprint, ROUTER_BIAS)
        served = generate(service.stub, PROMPT, greedy(N_TOKENS), "moe")
        assert list(served.token_ids) == list(reference.token_ids) and list(served.token_versions) == [1] * N_TOKENS
    finally:
        service.close()
