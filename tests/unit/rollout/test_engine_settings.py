"""vLLM's graph and memory arguments per platform, and the context `lorarl run` gives its rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.client.job.config import load_job_config, serving_length
from lorarl.client.launch.services import stack_sections
from lorarl.common.config import ConfigError, load_config
from lorarl.rollout.config import RolloutServiceConfig, RolloutSettings
from lorarl.rollout.vllm.engine import engine_memory_args

ROOT = Path(__file__).resolve().parents[3]


def test_cpu_runs_eager_with_a_fixed_kv_cache_and_gpus_capture_graphs() -> None:
    assert engine_memory_args(RolloutSettings(), on_cpu=True) == {"enforce_eager": True,
                                                                  "kv_cache_memory_bytes": 1 << 30}
    assert engine_memory_args(RolloutSettings(), on_cpu=False) == {"enforce_eager": False}
    gpu = RolloutSettings(gpu_memory_utilization=0.7, kv_cache_gib=8.0, enforce_eager=True)
    assert engine_memory_args(gpu, on_cpu=False) == {"enforce_eager": True, "kv_cache_memory_bytes": 8 << 30,
                                                     "gpu_memory_utilization": 0.7}
    assert "gpu_memory_utilization" not in engine_memory_args(gpu, on_cpu=True)


def test_rollout_memory_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        load_config(RolloutServiceConfig, overrides=["rollout.gpu_memory_utilization=1.5"], env={})
    config = load_config(RolloutServiceConfig, overrides=["rollout.enforce_eager=false"], env={})
    assert config.rollout.enforce_eager is False


def test_lorarl_run_sizes_the_context_from_prompt_and_completion(tmp_path: Path) -> None:
    demo = load_job_config(str(ROOT / "examples/demo.yaml"), [])
    assert serving_length(demo) == 2048  # the tiny model's own context: the demo is unchanged
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 40960}')
    long = load_job_config(str(ROOT / "examples/demo.yaml"), [
        f"model.path={model}", "data.max_prompt_tokens=512", "rollout.max_tokens=2048", "rollout.eval_max_tokens=4096"])
    assert serving_length(long) == 8192  # 512 + 4096 -> the next power of two
    assert serving_length(load_job_config(str(ROOT / "examples/demo.yaml"), [
        f"model.path={model}", "rollout.max_model_len=5000"])) == 5000
    sections = stack_sections(load_job_config(str(ROOT / "examples/demo.yaml"), [
        f"model.path={model}", "rollout.gpu_memory_utilization=0.8", "rollout.enforce_eager=false"]), tmp_path)
    assert sections["rollout"]["gpu_memory_utilization"] == 0.8 and sections["rollout"]["enforce_eager"] is False
    assert sections["rollout"]["max_model_len"] == 2048
    assert "enforce_eager" not in stack_sections(demo, tmp_path)["rollout"]


def test_the_trainer_accepts_every_sequence_the_rollout_can_return(tmp_path: Path) -> None:
    from lorarl.client.rl.loop import job_config_proto

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 40960}')
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"), [f"model.path={model}", "rollout.max_tokens=4096"])
    assert serving_length(cfg) == 8192  # 18 + 4096 tokens
    assert job_config_proto(cfg, str(model)).max_sequence_tokens == 8192  # not the trainer's default 4096
    demo = load_job_config(str(ROOT / "examples/demo.yaml"), [])
    assert job_config_proto(demo, "x").max_sequence_tokens == 4096


def test_the_job_file_selects_lora_and_the_in_worker_receive(tmp_path: Path) -> None:
    from lorarl.client.launch.services import cpu_pins

    demo = str(ROOT / "examples/demo.yaml")
    merged = load_job_config(demo, ["sync.mode=merged", "rollout.enable_lora=false", "rollout.receive_in_worker=on",
                                    "rollout.tensor_parallel_size=2"])
    section = stack_sections(merged, tmp_path)["rollout"]
    assert (section["enable_lora"], section["receive_in_worker"], section["tensor_parallel_size"]) == (False, "on", 2)
    assert cpu_pins(merged) == {}  # two workers are bound a CPU each by the rollout, not pinned together
    default = stack_sections(load_job_config(demo, []), tmp_path)["rollout"]
    assert "enable_lora" not in default and default["receive_in_worker"] == "auto"
    # a merged job's rollouts start without LoRA layers unless the job file asks for them
    assert stack_sections(load_job_config(demo, ["sync.mode=merged"]), tmp_path)["rollout"]["enable_lora"] is False
    kept = load_job_config(demo, ["sync.mode=merged", "rollout.enable_lora=true"])
    assert stack_sections(kept, tmp_path)["rollout"]["enable_lora"] is True
    with pytest.raises(ConfigError, match=r"rollout\.enable_lora.*sync\.mode=merged"):
        load_job_config(demo, ["rollout.enable_lora=false"])  # the demo serves adapters
    with pytest.raises(ConfigError, match="receive_in_worker"):
        load_job_config(demo, ["rollout.receive_in_worker=sometimes"])
