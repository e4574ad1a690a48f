"""The torch trainer engine and vLLM rollout on the Qwen3.6-27B architecture (hybrid Gated DeltaNet + attention).

A tiny random-init text-only Qwen3.5 (tests/unit/trainer/qwen3_5_tiny.py) stands in for Qwen3.6-27B:
same layer recipe, shrunk sizes. Trainer side: "all-linear" LoRA reaches the Gated DeltaNet projections,
GRPO learns, logprobs ignore right padding, and both exports reproduce the engine in transformers(+PEFT).
Rollout side (vLLM CPU, bf16 only: its Gated DeltaNet kernel refuses fp32): the trainer's adapter, sent
through the rollout service, gives the trainer's logprobs, and so do merged weights reloaded in place.
vLLM's qwen3_5 module imports torchvision (through Qwen3-VL's image processor) even for the text-only
model: `make setup` keeps the index's torchvision, importable beside the CPU torch through
lorarl/common/torchvision_cpu.py, so these tests run in `make test` with no skip.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.contract.lora import LoraSpec
from lorarl.rollout.config import RolloutSettings
from lorarl.trainer.engines.api import TrajectoryRecord
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.lora import LINEAR_ATTENTION_TARGETS, LoraConfig, LoRALinear, lora_modules, lora_parameters
from lorarl.v1 import common_pb2, rollout_pb2
from tests.integration.rollout.harness import RolloutHarness, generate, greedy, load_requests
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.qwen3_5_tiny import LAYER_TYPES, build_tiny_qwen3_5

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ATTENTION_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_TARGETS = {"gate_proj", "up_proj", "down_proj"}
IDS = torch.tensor([[257, 10, 55, 43, 52, 258, 10, 257, 9, 40, 41]])
PROMPT = (257, 115, 111, 114, 116, 32, 49)
N_TOKENS = 12
ADAPTER, MERGED = common_pb2.SYNC_MODE_ADAPTER, common_pb2.SYNC_MODE_MERGED


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))


def trained_engine(model_dir: Path, targets: tuple[str, ...] = ("all-linear",), seed: int = 3, std: float = 0.2
                   ) -> TorchEngine:
    """An engine whose adapters are far from zero, so every adapted projection changes the policy."""
    engine = TorchEngine(make_spec(model_dir, lora=LoraConfig(rank=8, alpha=16, target_modules=targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(engine.model):
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return engine


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


# --------------------------------------------------------------------------------------------- trainer


def test_fixture_has_the_qwen3_6_layer_recipe(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.config.model_type == "qwen3_5_text"
    assert model.config.layer_types == LAYER_TYPES and not model.config.tie_word_embeddings
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 264
    layers = model.model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [t == "linear_attention" for t in LAYER_TYPES]
    attn = layers[3].self_attn  # output gate: q_proj emits query and gate
    assert attn.q_proj.out_features == 2 * model.config.num_attention_heads * model.config.head_dim


def test_all_linear_adapts_gated_deltanet_attention_and_mlp_projections(model_dir: Path) -> None:
    engine = TorchEngine(make_spec(model_dir))
    adapted: dict[int, set[str]] = {}
    for name, module in lora_modules(engine.model):
        assert isinstance(module, LoRALinear)
        parts = name.split(".")
        adapted.setdefault(int(parts[2]), set()).add(parts[-1])
    linear = set(LINEAR_ATTENTION_TARGETS) | MLP_TARGETS
    assert adapted == {0: linear, 1: linear, 2: linear, 3: ATTENTION_TARGETS | MLP_TARGETS}
    trainable = set(engine.named_trainable_parameters())
    assert trainable and all(".lora_" in n for n in trainable)  # conv1d, A_log, dt_bias, norms, lm_head frozen
    only_gdn = TorchEngine(make_spec(model_dir, lora=LoraConfig(rank=4, alpha=8, target_modules=("in_proj_qkv",
                                                                                                  "out_proj"))))
    assert {n.rsplit(".", 1)[-1] for n, _ in lora_modules(only_gdn.model)} == {"in_proj_qkv", "out_proj"}
    with pytest.raises(ValueError, match=r"unknown names \['conv1d'\].*in_proj_qkv"):
        LoraConfig(target_modules=("conv1d",))
    with pytest.raises(ValueError, match="in_proj_z needs in_proj_qkv"):  # see the vLLM test below
        LoraConfig(target_modules=("in_proj_z", "out_proj"))


def test_logprobs_ignore_right_padding_through_the_linear_attention(model_dir: Path) -> None:
    engine = trained_engine(model_dir)
    records = synthetic_batch(0, vocab=264)
    batched = engine.compute_logprobs(records)
    for rec, got in zip(records, batched, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(engine.compute_logprobs([rec])[0]),
                                   atol=1e-5, rtol=0)


def test_grpo_steps_raise_the_rewarded_completion_and_lower_the_other(model_dir: Path) -> None:
    engine = TorchEngine(make_spec(model_dir, lr=2e-2))
    prompt, good, bad = [257, 5, 9], [10, 11, 12, 13], [20, 21, 22, 23]

    def batch() -> list[TrajectoryRecord]:
        records = [TrajectoryRecord(prompt, good, [], [], 1.0, "g"), TrajectoryRecord(prompt, bad, [], [], 0.0, "g")]
        for rec, lp in zip(records, engine.compute_logprobs(records), strict=True):
            rec.behavior_logprobs, rec.token_versions = lp, [engine.version] * len(lp)
        return records

    before = [sum(lp) for lp in engine.compute_logprobs(batch())]
    gdn = [m.lora_b for n, m in lora_modules(engine.model) if n.endswith("linear_attn.in_proj_qkv")]
    for _ in range(5):
        metrics = engine.train_step(batch())
    after = [sum(lp) for lp in engine.compute_logprobs(batch())]
    assert after[0] - before[0] > 1.0 and before[1] - after[1] > 1.0, (before, after)
    assert metrics["grad_norm"] > 0 and engine.version == 5
    assert all(float(b.detach().abs().max()) > 0 for b in gdn)  # the Gated DeltaNet adapters learned too


def test_peft_adapter_and_merged_export_reproduce_the_engine(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    engine = trained_engine(model_dir)
    want = logits(engine.model)
    adapter = engine.export_adapter(tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == set(LINEAR_ATTENTION_TARGETS) | ATTENTION_TARGETS | MLP_TARGETS
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    torch.testing.assert_close(logits(peft_model), want, atol=1e-4, rtol=0)
    with torch.no_grad(), peft_model.disable_adapter():
        assert (logits(peft_model) - want).abs().max() > 0.1  # the adapter matters, so the check above can fail

    merged_dir = engine.export_merged(tmp_path / "merged")
    assert load_file(str(merged_dir / "model.safetensors")).keys() == \
        load_file(str(model_dir / "model.safetensors")).keys()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    torch.testing.assert_close(logits(merged), want, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------ vLLM


@pytest.mark.vllm
def test_vllm_qwen3_5_module_imports_and_serves_the_gated_deltanet_targets() -> None:
    """vLLM's qwen3_5 imports Qwen3-VL (image processor -> torchvision) even for the text-only model."""
    module = importlib.import_module("vllm.model_executor.models.qwen3_5")
    packed = module.Qwen3_5ForCausalLM.packed_modules_mapping
    served = {name for names in packed.values() for name in names} | {"out_proj"}
    assert set(LINEAR_ATTENTION_TARGETS) <= served


def needs_vllm_qwen3_5(test: Callable[..., None]) -> Callable[..., None]:
    """A slow test on a live vLLM engine serving the tiny Qwen3.5."""
    for mark in (pytest.mark.vllm, pytest.mark.slow):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def service(model_dir: Path) -> Iterator[RolloutHarness]:
    # bf16: vLLM's CPU Gated DeltaNet kernel asserts BF16 activations.
    settings = RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="bfloat16", max_model_len=128,
                               kv_cache_gib=0.25, max_loras=2, max_lora_rank=8)
    harness = RolloutHarness(settings).start()
    yield harness
    harness.close()


def check_matches(engine: TorchEngine, out: rollout_pb2.Completion) -> None:
    """vLLM (bf16) gives the trainer's (fp32) logprobs of its greedy tokens, much closer than the base model's."""
    rec = TrajectoryRecord(list(PROMPT), list(out.token_ids), [], [], 0.0)
    got = torch.tensor(list(out.logprobs))
    policy = torch.tensor(engine.compute_logprobs([rec])[0])
    base = torch.tensor(engine.compute_logprobs([rec], reference=True)[0])
    error, signal = float((got - policy).abs().max()), float((got - base).abs().max())
    assert error < 0.05 and signal > 4 * error, (error, signal)


@needs_vllm_qwen3_5
@pytest.mark.parametrize(("targets", "std"), [
    (("in_proj_qkv",), 0.2),
    (("in_proj_qkv", "in_proj_z"), 0.2),
    (("in_proj_b", "in_proj_a"), 1.0),  # tiny projections (one row per value head): a bigger update to see
    (("out_proj",), 0.2),
    (LINEAR_ATTENTION_TARGETS, 0.2),
    (("all-linear",), 0.2),
], ids=["qkv", "qkv+z", "b+a", "out", "gated-deltanet", "all-linear"])
def test_vllm_serves_the_trainer_adapter(service: RolloutHarness, model_dir: Path, targets: tuple[str, ...],
                                         std: float) -> None:
    engine = trained_engine(model_dir, targets, std=std)
    tensors = dict(engine.iter_adapter_tensors())
    lora = LoraSpec(rank=8, alpha=16, target_modules=tuple(sorted({k.split(".lora_")[0].rsplit(".", 1)[-1]
                                                                        for k in tensors})))
    service.stub.LoadWeights(load_requests("gdn", 1, tensors, ADAPTER, base_model_fingerprint(model_dir), lora),
                             timeout=120)
    out = generate(service.stub, PROMPT, greedy(N_TOKENS, logprobs=0), "gdn", 1)
    assert list(out.token_versions) == [1] * N_TOKENS
    check_matches(engine, out)
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="gdn"))


@needs_vllm_qwen3_5
def test_vllm_reloads_the_trainer_merged_weights(service: RolloutHarness, model_dir: Path) -> None:
    engine = trained_engine(model_dir, seed=5)
    fingerprint = base_model_fingerprint(model_dir)
    base = generate(service.stub, PROMPT, greedy(N_TOKENS))
    weights = dict(engine.iter_merged_tensors())  # HF names: vLLM re-packs in_proj_qkv/z and in_proj_b/a itself
    service.stub.LoadWeights(load_requests("merged", 1, weights, MERGED, fingerprint), timeout=120)
    out = generate(service.stub, PROMPT, greedy(N_TOKENS, logprobs=0), "merged")
    assert list(out.token_versions) == [1] * N_TOKENS
    check_matches(engine, out)
    service.stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id="merged"))
    assert list(generate(service.stub, PROMPT, greedy(N_TOKENS)).token_ids) == list(base.token_ids)


@needs_vllm_qwen3_5
def test_vllm_cannot_load_in_proj_z_without_in_proj_qkv(service: RolloutHarness, model_dir: Path) -> None:
    """Why LoraConfig refuses in_proj_z alone: vLLM's packed in_proj_qkvz LoRA layer fails to split it."""
    engine = trained_engine(model_dir)
    tensors = {k: v for k, v in engine.iter_adapter_tensors() if ".in_proj_z." in k}
    lora = LoraSpec(rank=8, alpha=16, target_modules=("in_proj_z",))
    with pytest.raises(grpc.RpcError) as info:
        service.stub.LoadWeights(load_requests("z", 1, tensors, ADAPTER, base_model_fingerprint(model_dir), lora),
                                 timeout=120)
    assert "Cannot determine how to split lora_b" in info.value.details()
    out = generate(service.stub, PROMPT, greedy(N_TOKENS))  # the engine still serves the base model
    assert len(out.token_ids) == N_TOKENS and list(out.token_versions) == [0] * N_TOKENS
