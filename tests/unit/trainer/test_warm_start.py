"""Warm start (JobConfig.init_adapter_path, the job file's trainer.init_adapter): a job starts from a PEFT
LoRA adapter whose rank, alpha, targets and rsLoRA match its LoRA section; what lorarl's layers cannot
train (DoRA, per-module ranks, extra trained modules, biases) is refused before anything starts, naming
the PEFT field; the adapter serves as version 1, the base model stays version 0."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from lorarl.client.cli import main
from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.lora import LoraSpec
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.lora import LoraConfig, peft_state_dict
from lorarl.trainer.service.jobs import JobManager
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.tiny import randomize_adapters

ROOT = Path(__file__).resolve().parents[3]
LORA = LoraConfig(rank=4, alpha=8)


@pytest.fixture(scope="module")
def adapter(dense_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained-looking adapter exported by the engine (PEFT files, as `lorarl export` writes them)."""
    engine = TorchEngine(make_spec(dense_dir, device="cpu", lora=LORA))
    randomize_adapters(engine.model, seed=11, std=0.1)
    return engine.export_adapter(tmp_path_factory.mktemp("adapter") / "warm")


def edited(adapter: Path, tmp_path: Path, **changes: object) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(adapter, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    config.update(changes)
    (copy / "adapter_config.json").write_text(json.dumps(config))
    return copy


def test_a_job_starts_from_the_adapter_as_version_1(dense_dir: Path, adapter: Path) -> None:
    source = TorchEngine(make_spec(dense_dir, device="cpu", lora=LORA))
    randomize_adapters(source.model, seed=11, std=0.1)
    warm = TorchEngine(make_spec(dense_dir, device="cpu", lora=LORA, init_adapter_path=str(adapter)))
    fresh = TorchEngine(make_spec(dense_dir, device="cpu", lora=LORA))
    assert (warm.version, fresh.version) == (1, 0)
    for name, tensor in peft_state_dict(source.model).items():
        torch.testing.assert_close(peft_state_dict(warm.model)[name], tensor, rtol=0, atol=0)
    batch = synthetic_batch(0, vocab=warm.vocab_size)
    assert warm.compute_logprobs(batch) == source.compute_logprobs(batch) != fresh.compute_logprobs(batch)
    assert warm.compute_logprobs(batch, reference=True) == fresh.compute_logprobs(batch, reference=True)  # the base
    warm.train_step(batch)
    assert warm.version == 2


@pytest.mark.parametrize(("changes", "words"), [
    ({"use_dora": True}, "use_dora is set (DoRA)"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is set"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save is set"),
    ({"bias": "all"}, "bias is 'all'"),
    ({"r": 8}, "r is 8 but the job's trainer.lora.rank is 4: set trainer.lora.rank: 8"),
    ({"lora_alpha": 32}, "lora_alpha is 32 but the job's trainer.lora.alpha is 8"),
    ({"use_rslora": True}, "use_rslora is True but the job's trainer.lora.use_rslora is False"),
    ({"target_modules": ["c_attn"]}, "target_modules names ['c_attn']"),
    ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
])
def test_what_lorarl_cannot_train_is_refused_naming_the_field(changes: dict, words: str, dense_dir: Path,
                                                               adapter: Path, tmp_path: Path, capsys) -> None:
    bad = edited(adapter, tmp_path, **changes)
    assert any(words in p for p in LORA.warm_start_problems(json.loads((bad / "adapter_config.json").read_text())))
    # the trainer refuses it at CreateJob ...
    manager = JobManager()
    with pytest.raises(InvalidArgumentError) as refused:
        asyncio.run(manager.create("warm", make_spec(dense_dir, device="cpu", lora=LORA, init_adapter_path=str(bad))))
    assert refused.value.field == "config.init_adapter_path" and words in str(refused.value)
    # ... and the job file's check before any service starts
    overrides = ["trainer.lora.rank=4", "trainer.lora.alpha=8", f"trainer.init_adapter={bad}"]
    assert main(["run", str(ROOT / "examples/demo.yaml"), "--dry-run", *overrides]) == 2
    out = capsys.readouterr().out
    assert "lorarl: bad config: trainer.init_adapter:" in out and words in out


def test_missing_files_a_pickle_and_tensors_that_do_not_fit_are_refused(dense_dir: Path, adapter: Path,
                                                                        tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    manager = JobManager()
    for path, words in ((tmp_path / "nowhere", "is not a directory"), (pickled, "is a pickle")):
        with pytest.raises(InvalidArgumentError, match=words):
            asyncio.run(manager.create("warm", make_spec(dense_dir, device="cpu", lora=LORA,
                                                         init_adapter_path=str(path))))
    # an adapter of fewer modules than the job adapts: its config passes, its tensors do not fit
    narrow = edited(adapter, tmp_path, target_modules=["q_proj"])
    spec = make_spec(dense_dir, device="cpu", lora=LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj")),
                     init_adapter_path=str(narrow))
    with pytest.raises(InvalidArgumentError, match=r"init_adapter_path .*adapter tensors do not match the model"):
        asyncio.run(manager.create("warm", spec))
    assert not LoraSpec(rank=4, alpha=8).warm_start_problems(
        json.loads((adapter / "adapter_config.json").read_text()))


def test_a_warm_start_needs_the_torch_engine_and_adapters(dense_dir: Path, adapter: Path) -> None:
    with pytest.raises(ValueError, match=r"init_adapter_path .* needs engine 'torch' and adapters"):
        make_spec(dense_dir, engine="megatron", init_adapter_path=str(adapter))
    with pytest.raises(ValueError, match="needs engine 'torch' and adapters"):
        make_spec(dense_dir, full_finetune=True, init_adapter_path=str(adapter))


def test_malformed_fields_and_a_narrower_adapter_than_all_linear_are_problems() -> None:
    spec = LoraSpec(rank=4, alpha=8)
    assert any("r is '4': not a valid value" in p for p in spec.warm_start_problems({"r": "4", "lora_alpha": 8}))
    assert any("not a valid value" in p for p in spec.warm_start_problems({"r": 4, "lora_alpha": 8,
                                                                          "target_modules": 5}))
    narrow = spec.warm_start_problems({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    assert any("set trainer.lora.target_modules: ['q_proj', 'v_proj']" in p for p in narrow)
    assert any("layers_to_transform is set" in p for p in spec.warm_start_problems(
        {"r": 4, "lora_alpha": 8, "layers_to_transform": 0}))
