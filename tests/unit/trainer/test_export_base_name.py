"""Exported adapters name their base as the job named it (a Hub id, the path as written), not the trainer's
folder: PEFT loads the base from adapter_config.json's base_model_name_or_path, and an absolute path of the
training host names nothing elsewhere. The live export, a checkpoint's offline export and the job file agree."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from lorarl.client.job.config import base_model_name, load_job_config, training_spec
from lorarl.contract.training import TrainingSpec
from lorarl.trainer.engines.offline_export import export_checkpoint
from lorarl.trainer.engines.torch.engine import TorchEngine
from tests.unit.trainer.engine_utils import make_spec

ROOT = Path(__file__).resolve().parents[3]
HUB_ID = "Qwen/Qwen3-0.6B"


def recorded_base(adapter: Path) -> str:
    return json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_the_job_names_its_base_as_written_and_the_spec_carries_it_over_grpc() -> None:
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"), [])
    assert Path(cfg.model.path).is_absolute()  # resolved for the services to load ...
    assert base_model_name(cfg) == "lorarl/assets/models/qwen3-tiny"  # ... named as the job file wrote it
    spec = training_spec(cfg, cfg.model.path)
    assert spec.base_model_name_or_path == "lorarl/assets/models/qwen3-tiny"
    assert TrainingSpec.from_proto(spec.to_proto()).base_model_name_or_path == "lorarl/assets/models/qwen3-tiny"
    hub = load_job_config(str(ROOT / "examples/demo.yaml"), [f"model.path={HUB_ID}"])
    assert training_spec(hub, "/cache/snapshots/abc").base_model_name_or_path == HUB_ID
    # a client that names no base (an older one, a raw JobConfig): the path the trainer loads
    assert TrainingSpec(base_model_path="/models/m").base_model_name_or_path == "/models/m"


def test_the_live_and_the_offline_export_record_the_jobs_name(dense_dir: Path, tmp_path: Path) -> None:
    engine = TorchEngine(replace(make_spec(dense_dir), base_model_name=HUB_ID))
    assert recorded_base(engine.export_adapter(tmp_path / "live")) == HUB_ID
    checkpoint = engine.save_checkpoint(tmp_path / "ckpt").path
    assert recorded_base(export_checkpoint(checkpoint, tmp_path / "offline", "adapter")) == HUB_ID
    unnamed = TorchEngine(make_spec(dense_dir))
    assert recorded_base(unnamed.export_adapter(tmp_path / "unnamed")) == str(dense_dir)
