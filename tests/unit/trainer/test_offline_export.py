"""`lorarl export --checkpoint`: a checkpoint becomes the adapter or merged model the live trainer
exports, with no service running; stock PEFT and transformers load both; bad inputs exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lorarl.client.cli import main
from lorarl.trainer.engines.torch.engine import TorchEngine
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.test_torch_engine import logits


@pytest.fixture(scope="module")
def trained(dense_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """A checkpoint after three steps, the live trainer's exports of that state, and its logits."""
    root = tmp_path_factory.mktemp("trained")
    engine = TorchEngine(make_spec(dense_dir, lr=5e-2))
    for seed in (1, 2, 3):
        engine.train_step(synthetic_batch(seed, version=engine.version))
    checkpoint = engine.save_checkpoint(root / "ckpt").path
    engine.export_adapter(root / "live" / "adapter")
    engine.export_merged(root / "live" / "merged")
    return checkpoint, root / "live", logits(engine.model)


def export(*args: str) -> int:
    return main(["export", *args])


def same_tensors(a: Path, b: Path) -> None:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    for name in x:
        assert torch.equal(x[name], y[name]), name


def test_offline_adapter_equals_the_live_export_and_loads_in_peft(trained, dense_dir: Path, tmp_path: Path,
                                                                  capsys) -> None:
    from peft import PeftModel

    checkpoint, live, adapted = trained
    assert export("--checkpoint", str(checkpoint), "--mode", "adapter", "--out", str(tmp_path / "a")) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a")
    same_tensors(tmp_path / "a" / "adapter_model.safetensors", live / "adapter" / "adapter_model.safetensors")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text()) == \
        json.loads((live / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "a")).eval()
    assert (logits(peft_model) - adapted).abs().max() <= 1e-4


def test_offline_merged_model_equals_the_live_export_and_loads_in_transformers(trained, tmp_path: Path) -> None:
    checkpoint, live, adapted = trained
    assert export("--checkpoint", str(checkpoint), "--mode", "merged", "--out", str(tmp_path / "m")) == 0
    same_tensors(tmp_path / "m" / "model.safetensors", live / "merged" / "model.safetensors")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    assert (logits(merged) - adapted).abs().max() <= 1e-4


def test_a_moved_base_model_is_found_with_base_model(trained, dense_dir: Path, tmp_path: Path) -> None:
    checkpoint, live, _ = trained
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["base_model_path"] = str(tmp_path / "gone")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert export("--checkpoint", str(copy), "--out", str(tmp_path / "x")) == 2
    assert export("--checkpoint", str(copy), "--out", str(tmp_path / "a"), "--base-model", str(dense_dir)) == 0
    same_tensors(tmp_path / "a" / "adapter_model.safetensors", live / "adapter" / "adapter_model.safetensors")


def test_bad_checkpoints_are_one_line_errors_with_exit_code_2(trained, moe_dir: Path, tmp_path: Path,
                                                              capsys) -> None:
    checkpoint, _, _ = trained
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "manifest.json").write_text('{"format": "something-else"}')
    cases = {
        "missing": ["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o1")],
        "foreign": ["--checkpoint", str(tmp_path / "foreign"), "--out", str(tmp_path / "o2")],
        "other base": ["--checkpoint", str(checkpoint), "--out", str(tmp_path / "o3"), "--base-model", str(moe_dir)],
        "no out": ["--checkpoint", str(checkpoint)],
    }
    messages = {}
    for name, argv in cases.items():
        capsys.readouterr()
        assert export(*argv) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("lorarl export: ") and "\n" not in err, (name, err)
        messages[name] = err
    assert "no checkpoint directory" in messages["missing"]
    assert "not a lorarl-trainer-checkpoint manifest" in messages["foreign"]
    assert "is not the one checkpoint" in messages["other base"]
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))
