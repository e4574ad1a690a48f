"""Checkpoints: bit-exact resume, refusal of foreign or corrupt checkpoints, atomic saves, fingerprints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.trainer.engines import checkpoint as ckpt
from lorarl.trainer.engines.api import TrainingSpec
from lorarl.trainer.engines.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.rl.lora import LoraConfig
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch
from tests.unit.trainer.tiny import dense_model

BATCHES = [synthetic_batch(seed) for seed in range(4)]


def resumable_spec(path: Path) -> TrainingSpec:
    # Dropout makes the result depend on the RNG state; warmup + cosine on the restored step;
    # weight decay and micro-batches on the optimiser state and the data path.
    return make_spec(path, lr=1e-2, micro_batch_tokens=20, lora=LoraConfig(rank=4, alpha=8, dropout=0.1),
                     optimizer={"warmup_steps": 2, "total_steps": 6, "weight_decay": 0.01})


def adapters(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.named_trainable_parameters().items()}


def test_resume_is_bit_exact(dense_dir: Path, tmp_path: Path) -> None:
    straight = TorchEngine(resumable_spec(dense_dir))
    straight_losses = [straight.train_step(b)["loss"] for b in BATCHES]

    first = TorchEngine(resumable_spec(dense_dir))
    losses = [first.train_step(b)["loss"] for b in BATCHES[:2]]
    info = first.save_checkpoint(tmp_path / "ckpt", data_cursor={"epoch": 0, "next": 2})
    assert (info.step, info.version) == (2, 2)
    del first

    resumed = TorchEngine(resumable_spec(dense_dir))
    loaded = resumed.load_checkpoint(tmp_path / "ckpt")
    assert loaded.data_cursor == {"epoch": 0, "next": 2}
    assert (resumed.step, resumed.version) == (2, 2)
    losses += [resumed.train_step(b)["loss"] for b in BATCHES[loaded.data_cursor["next"]:]]

    assert losses == straight_losses
    final, expected = adapters(resumed), adapters(straight)
    assert all(torch.equal(final[n], expected[n]) for n in expected)
    assert resumed.version == straight.version == 4


def test_resume_without_rng_restore_would_differ(dense_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Guards the test above: with dropout on, skipping the RNG restore changes the result."""
    straight = TorchEngine(resumable_spec(dense_dir))
    expected = [straight.train_step(b)["loss"] for b in BATCHES][2:]
    first = TorchEngine(resumable_spec(dense_dir))
    for b in BATCHES[:2]:
        first.train_step(b)
    first.save_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(ckpt, "restore_rng", lambda *_: None)
    resumed = TorchEngine(resumable_spec(dense_dir))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert [resumed.train_step(b)["loss"] for b in BATCHES[2:]] != expected


@pytest.fixture
def saved(dense_dir: Path, tmp_path: Path) -> tuple[TorchEngine, Path]:
    engine = TorchEngine(make_spec(dense_dir))
    engine.train_step(BATCHES[0])
    path = tmp_path / "ckpt"
    engine.save_checkpoint(path)
    return engine, path


def test_refuses_a_checkpoint_of_another_base_model(saved: tuple[TorchEngine, Path], moe_dir: Path,
                                                    tmp_path: Path) -> None:
    _, path = saved
    other_dir = tmp_path / "other-dense"
    dense_model(seed=1).save_pretrained(other_dir)  # same shapes, other weights
    for model_dir in (other_dir, moe_dir):
        engine = TorchEngine(make_spec(model_dir))
        with pytest.raises(CheckpointMismatchError, match="fingerprint"):
            engine.load_checkpoint(path)


def test_refuses_a_checkpoint_of_another_lora_spec(saved: tuple[TorchEngine, Path], dense_dir: Path) -> None:
    _, path = saved
    engine = TorchEngine(make_spec(dense_dir, lora=LoraConfig(rank=8, alpha=8)))
    with pytest.raises(CheckpointMismatchError, match=r"lora\.rank 4 != this job's 8"):
        engine.load_checkpoint(path)
    engine = TorchEngine(make_spec(dense_dir, lora=LoraConfig(rank=4, alpha=8, target_modules=("q_proj",))))
    with pytest.raises(CheckpointMismatchError, match=r"lora\.target_modules"):
        engine.load_checkpoint(path)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "error", "words"), [
    (lambda p: _truncate(p / ckpt.PARAMS_FILE), CheckpointCorruptError, "truncated"),
    (lambda p: _flip_byte(p / ckpt.OPTIMIZER_FILE), CheckpointCorruptError, "checksum"),
    (lambda p: _flip_byte(p / ckpt.STATE_FILE), CheckpointCorruptError, "checksum"),
    (lambda p: (p / ckpt.RNG_FILE).unlink(), CheckpointCorruptError, r"missing rng\.safetensors"),
    (lambda p: (p / ckpt.MANIFEST).write_text("{not json"), CheckpointCorruptError, "not valid JSON"),
    (lambda p: (p / ckpt.MANIFEST).unlink(), CheckpointCorruptError, r"no manifest\.json"),
    (lambda p: shutil.rmtree(p), CheckpointError, "no checkpoint directory"),
], ids=["truncated", "garbled-optimizer", "garbled-state", "missing-file", "garbled-manifest", "no-manifest",
        "no-dir"])
def test_refuses_a_corrupt_checkpoint_and_leaves_the_engine_untouched(saved: tuple[TorchEngine, Path],
                                                                      dense_dir: Path, damage, error: type,
                                                                      words: str) -> None:
    _, path = saved
    damage(path)
    engine = TorchEngine(make_spec(dense_dir))
    before = adapters(engine)
    with pytest.raises(error, match=words) as err:
        engine.load_checkpoint(path)
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, ValueError)
    assert engine.version == 0 and all(torch.equal(before[n], p) for n, p in adapters(engine).items())


def test_refuses_a_manifest_from_a_future_format(saved: tuple[TorchEngine, Path], dense_dir: Path) -> None:
    _, path = saved
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["format_version"] = 99
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99"):
        TorchEngine(make_spec(dense_dir)).load_checkpoint(path)


def test_failed_save_keeps_the_last_good_checkpoint(saved: tuple[TorchEngine, Path], dense_dir: Path,
                                                    monkeypatch) -> None:
    engine, path = saved
    good = adapters(engine)
    engine.train_step(BATCHES[1])
    calls = {"n": 0}
    real_write = ckpt._write_file

    def flaky(target: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("No space left on device")
        real_write(target, data)

    monkeypatch.setattr(ckpt, "_write_file", flaky)
    with pytest.raises(CheckpointError, match="previous checkpoint kept"):
        engine.save_checkpoint(path)
    assert calls["n"] == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]  # no temp dir left behind
    monkeypatch.undo()

    fresh = TorchEngine(make_spec(dense_dir))
    assert fresh.load_checkpoint(path).version == 1
    assert all(torch.equal(good[n], p) for n, p in adapters(fresh).items())

    engine.save_checkpoint(path, data_cursor=7)  # a later good save replaces it
    assert fresh.load_checkpoint(path).version == 2 and fresh.load_checkpoint(path).data_cursor == 7
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]


def test_non_json_data_cursor_is_refused_before_writing(saved: tuple[TorchEngine, Path], tmp_path: Path) -> None:
    engine, _ = saved
    with pytest.raises(CheckpointError, match="JSON"):
        engine.save_checkpoint(tmp_path / "other", data_cursor=object())
    assert not (tmp_path / "other").exists()


def test_no_pickle_in_a_checkpoint(saved: tuple[TorchEngine, Path]) -> None:
    _, path = saved
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [ckpt.MANIFEST, ckpt.PARAMS_FILE, ckpt.OPTIMIZER_FILE, ckpt.RNG_FILE, ckpt.STATE_FILE])
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert manifest["lora"]["rank"] == 4 and manifest["loss"]["type"] == "grpo"
    assert manifest["base_model_fingerprint"].startswith("sha256:")


def test_fingerprint_is_stable_and_tells_models_apart(tmp_path: Path) -> None:
    dense_model(seed=0).save_pretrained(tmp_path / "a")
    dense_model(seed=0).save_pretrained(tmp_path / "b")
    dense_model(seed=1).save_pretrained(tmp_path / "c")
    fa, fb, fc = (base_model_fingerprint(tmp_path / n) for n in "abc")
    assert fa == fb and fa != fc
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    config["transformers_version"] = "0.0.0"
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    assert base_model_fingerprint(tmp_path / "b") != fa
    with pytest.raises(ValueError, match=r"config\.json"):
        base_model_fingerprint(tmp_path)
