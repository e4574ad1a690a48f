"""Job configs for real models are checked by a dry run: validation, memory plan and placement."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lorarl.client.cli import main
from lorarl.client.job.config import load_job_config
from lorarl.client.job.plan import KNOWN_SHAPES, count, human_bytes, human_count, place
from lorarl.client.launch.services import stack_sections, visible_devices
from lorarl.common.config import ConfigError
from lorarl.trainer.engines.memory import stage_sizes

ROOT = Path(__file__).resolve().parents[3]
NPU_JOB_FILES = sorted((ROOT / "examples/npu").glob("*.yaml"))
JOB_FILES = (sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "examples/models").glob("*.yaml"))
             + NPU_JOB_FILES)


@pytest.fixture(scope="module", autouse=True)
def gsm8k_rows(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The real-model examples train on GSM8K, which is not shipped: a few rows in its format stand in."""
    folder = tmp_path_factory.mktemp("gsm8k")
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(
            {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}) for i in range(3)))
    GSM8K.update({"data.train_path": str(folder / "train.jsonl"), "data.test_path": str(folder / "test.jsonl")})


GSM8K: dict[str, str] = {}


def dry_run(capsys, path: Path, *overrides: str, data: bool = True) -> tuple[int, str]:
    """``lorarl run PATH OVERRIDES --dry-run``; a GSM8K job reads the stand-in rows unless ``data`` is off."""
    try:
        gsm8k = load_job_config(str(path), list(overrides)).data.source == "gsm8k"
    except ConfigError:
        gsm8k = False  # the dry run reports it
    if data and gsm8k:
        overrides = (*overrides, *(f"{k}={v}" for k, v in GSM8K.items()))
    code = main(["run", str(path), *overrides, "--dry-run"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_every_example_job_passes_the_dry_run(capsys) -> None:
    names = {p.name for p in JOB_FILES}
    assert {"demo.yaml", "moe-merged.yaml", "qwen3-0.6b.yaml", "qwen3-8b.yaml", "qwen3-30b-a3b.yaml",
            "qwen3.6-27b.yaml", "qwen3.6-27b-multinode.yaml"} <= names
    for path in JOB_FILES:
        code, out = dry_run(capsys, path)
        assert code == 0, f"{path.name}: {out}"
        assert out.rstrip().endswith("config OK"), path.name


def test_every_real_model_example_dry_runs_on_a_fresh_clone_and_run_refuses_its_missing_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Issue "the first hour": GSM8K is not shipped, so on a fresh clone every examples/models job's data is missing.
    Its dry run still prints the plan and exits 0, the data a WARNING naming the key and the command that writes it;
    `lorarl run` refuses it, naming the key, before anything starts."""
    monkeypatch.chdir(tmp_path)  # no data/gsm8k here, whatever the checkout holds
    for path in sorted((ROOT / "examples/models").glob("*.yaml")):
        code = main(["run", str(path), "--dry-run"])
        out = capsys.readouterr().out
        folder = Path(load_job_config(str(path), []).data.train_path).parent.as_posix()
        assert code == 0 and out.rstrip().endswith("config OK, with 2 WARNINGS above"), f"{path.name}: {out}"
        assert "WARNING data.train_path: no such file" in out and "WARNING data.test_path: no such file" in out
        assert f"hint: `lorarl data gsm8k {folder}` writes {folder}/train.jsonl and test.jsonl" in out, out
    code = main(["run", str(ROOT / "examples/models/qwen3-0.6b.yaml"), f"output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "lorarl: bad config: data.train_path: no such file: 'data/gsm8k/train.jsonl'; `lorarl data " \
                         "gsm8k data/gsm8k`" in err, err
    code = main(["eval", str(ROOT / "examples/models/qwen3-0.6b.yaml"), f"output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err  # eval reads the held-out split only, before its rollout starts
    assert code == 2 and "lorarl: bad config: data.test_path: no such file: 'data/gsm8k/test.jsonl'" in err, err
    assert not (tmp_path / "run" / "services").exists() and not (tmp_path / "run" / "eval").exists()


def test_npu_jobs_pass_the_ascend_checks_and_the_demo_settings_fail_them(capsys) -> None:
    assert {p.name for p in NPU_JOB_FILES} == {"qwen3-0.6b.yaml", "qwen3-30b-a3b-merged.yaml"}
    for path in NPU_JOB_FILES:
        cfg = load_job_config(str(path), [])  # validation, Ascend rules included
        assert (cfg.trainer.device, cfg.model.dtype, cfg.rollout.block_size) == ("npu", "bfloat16", 128)
    code, out = dry_run(capsys, ROOT / "examples/npu/qwen3-30b-a3b-merged.yaml")
    assert code == 0 and "trainer: 34.0 GiB of 64.0 GiB per device: fits" in out
    assert "rollout: 40.4 GiB of 64.0 GiB per device: fits" in out
    assert "node 0: trainer (devices 0-1), rollout-0 (devices 2-3)" in out
    # On one 64 GiB NPU the whole bf16 base (56.9 GiB) and the smallest step do not fit.
    code, out = dry_run(capsys, ROOT / "examples/npu/qwen3-30b-a3b-merged.yaml", "trainer.parallel.pipeline=1",
                        "trainer.optimizer.micro_batch_tokens=2304", "trainer.memory.activation_checkpointing=on",
                        "trainer.memory.logits_chunk_tokens=128")
    assert code == 2 and "trainer: 58.1 GiB of 64.0 GiB per device: DOES NOT FIT" in out
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml", "trainer.device=npu")
    assert code == 2 and "model.dtype: float32 is not served on Ascend" in out
    assert "rollout.block_size: 16 tokens; Ascend's attention kernel takes 128-token blocks" in out
    code, out = dry_run(capsys, ROOT / "examples/npu/qwen3-0.6b.yaml", "trainer.engine=megatron")
    assert code == 2 and "trainer.engine: megatron-core needs MindSpeed" in out
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml", "trainer.device=cpu", "rollout.block_size=16")
    assert code == 0  # the same settings are fine off Ascend


def test_a_nz_cast_setting_in_the_environment_fails_an_npu_job(capsys, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1")
    code, out = dry_run(capsys, ROOT / "examples/npu/qwen3-0.6b.yaml")
    assert code == 2 and "VLLM_ASCEND_ENABLE_NZ=1 is set: vllm-ascend refuses RL weight updates" in out
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    assert dry_run(capsys, ROOT / "examples/npu/qwen3-0.6b.yaml")[0] == 0


def test_a_torch_layer_split_plans_its_fullest_device_and_runs_as_one_process(capsys) -> None:
    """parallel.pipeline on the torch engine: whole layers per device, the embeddings and head on the
    first (lorarl.trainer.engines.memory.stage_sizes), one trainer process, one device computing."""
    path = ROOT / "examples/models/qwen3-8b.yaml"
    _, whole = dry_run(capsys, path, "trainer.memory.activation_checkpointing=on", "trainer.parallel.data=1")
    code, split = dry_run(capsys, path, "trainer.memory.activation_checkpointing=on", "trainer.parallel.data=1",
                          "trainer.parallel.pipeline=2")
    assert code == 0 and "decoder layers split across 2 devices" in split

    def base(out: str) -> float:
        return float(out.split("per device base ")[1].split(" GiB")[0])

    shape = KNOWN_SHAPES["qwen3-8b"]
    n = count(shape, 16)
    # 36 layers of 0.193 B parameters and 1.24 B outside them (embeddings, head): 18/18 would put 4.72 B on
    # the first device, 15/21 puts 4.14 B there and 4.05 B on the second, 14/22 4.24 B on the second.
    per_layer = (n["base"] - n["outside_layers"]) / shape["num_hidden_layers"]
    assert stage_sizes(n["outside_layers"], [per_layer] * 36, 2) == [15, 21]
    fullest = n["outside_layers"] + 15 * per_layer
    assert base(split) == pytest.approx(fullest * 2 / 2**30, abs=0.05)
    assert base(split) < base(whole) * 0.6
    cfg = load_job_config(str(path), ["trainer.parallel.data=1", "trainer.parallel.pipeline=2"])
    assert cfg.trainer.parallel.ranks("torch") == 1 and cfg.trainer.parallel.ranks("megatron") == 2
    assert "ranks" not in stack_sections(cfg, Path("/tmp"))["trainer"]
    with pytest.raises(ConfigError, match=r"trainer\.parallel\.data"):
        load_job_config(str(path), ["trainer.parallel.pipeline=2", "trainer.parallel.data=2"])
    with pytest.raises(ConfigError, match=r"tensor/expert parallelism needs trainer\.engine=megatron"):
        load_job_config(str(path), ["trainer.parallel.tensor=2"])


def test_published_parameter_counts() -> None:
    """The planner's counts match the published sizes (0.6B, 8.2B, 32.8B, 30.5B, 27.8B)."""
    expected = {"qwen3-0.6b": 0.596e9, "qwen3-8b": 8.19e9, "qwen3-32b": 32.8e9, "qwen3-30b-a3b": 30.5e9,
                "qwen3.6-27b": 27.8e9}
    for name, params in expected.items():
        assert count(KNOWN_SHAPES[name], 16)["base"] == pytest.approx(params, rel=0.01), name


def test_tiny_models_are_read_from_their_config(capsys) -> None:
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml")
    assert code == 0 and "1.02 M parameters (3.9 MiB in float32)" in out
    code, out = dry_run(capsys, ROOT / "examples/moe-merged.yaml")
    assert "1.81 M parameters" in out and "8 experts" in out and "weight sync: merged" in out


def test_expert_mode_changes_the_adapter_size() -> None:
    shape = KNOWN_SHAPES["qwen3-30b-a3b"]
    per_expert, shared, none = (count(shape, 16, mode)["lora"] for mode in ("per_expert", "shared", "none"))
    assert per_expert > 40 * shared and shared > none > 0


def test_the_plan_counts_the_targets_adapted_and_refuses_targets_that_match_nothing(capsys) -> None:
    """Issue "the first hour": target_modules [q_prj] was "config OK" and counted as all-linear. Unknown names are
    refused when the job file loads; names this model has no module of (linear attention on a dense Qwen3) are
    refused by the plan; the adapter size counts what is adapted."""
    shape = KNOWN_SHAPES["qwen3-8b"]
    everything, attention = count(shape, 16)["lora"], count(shape, 16, targets=frozenset({"q_proj", "v_proj"}))
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    assert attention["lora"] == layers * 16 * ((h + q) + (h + kv)) < everything
    assert count(shape, 16, targets=frozenset({"in_proj_qkv"}))["lora"] == 0
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml", "trainer.lora.target_modules=[in_proj_qkv]")
    assert code == 2 and "match no module of" in out and "q_proj, k_proj, v_proj" in out
    with pytest.raises(ConfigError, match=r"trainer.lora.target_modules: has unknown names \['q_prj'\]"):
        load_job_config(str(ROOT / "examples/demo.yaml"), ["trainer.lora.target_modules=[q_prj]"])


def test_run_checks_the_plan_before_it_starts_anything(tmp_path: Path, capsys) -> None:
    """`lorarl run` without --dry-run refuses what the plan refuses before a service starts (it used to start the
    services first), and a GRPO-family job with one sample per prompt is refused when its file loads."""
    out = tmp_path / "run"
    assert main(["run", str(ROOT / "examples/demo.yaml"), "trainer.lora.target_modules=[in_proj_qkv]",
                 f"output.dir={out}"]) == 2
    assert "match no module of" in capsys.readouterr().err and not (out / "services").exists()
    with pytest.raises(ConfigError, match=r"rollout.group_size: is 1 with trainer.loss.type 'grpo'.*every advantage "
                                          r"would be 0"):
        load_job_config(str(ROOT / "examples/demo.yaml"), ["rollout.group_size=1"])
    load_job_config(str(ROOT / "examples/demo.yaml"), ["rollout.group_size=1", "trainer.loss.type=cross_entropy"])


def test_units_follow_the_size() -> None:
    assert human_count(1_016_832) == "1.02 M" and human_count(8.19e9) == "8.19 B" and human_count(900) == "900"
    assert human_bytes(3 << 20) == "3.0 MiB" and human_bytes(5 << 30) == "5.0 GiB"


def test_placement_of_the_multinode_job(capsys) -> None:
    cfg = load_job_config(str(ROOT / "examples/models/qwen3.6-27b-multinode.yaml"), [])
    slots = place(cfg)
    trainers = [s for s in slots if s.role == "trainer"]
    assert [(s.node, s.devices) for s in trainers] == [(0, tuple(range(8))), (1, tuple(range(8)))]
    rollouts = [s for s in slots if s.role.startswith("rollout")]
    assert len(rollouts) == 16 and {s.node for s in rollouts} == {2, 3}
    used = [(s.node, d) for s in slots for d in s.devices]
    assert len(used) == len(set(used)) == 32  # every device used once
    _, out = dry_run(capsys, ROOT / "examples/models/qwen3.6-27b-multinode.yaml")
    assert "node 3: rollout-8 (device 0)" in out


def test_tensor_parallel_groups_stay_on_one_node(capsys) -> None:
    cfg = load_job_config(str(ROOT / "examples/models/qwen3-30b-a3b.yaml"), [])
    assert [s.devices for s in place(cfg)] == [(0,), (1, 2), (3, 4), (5, 6)]
    # 8 devices for 8 ranks, but two TP-3 groups cannot be packed into 2 nodes x 4 beside 2 trainer ranks.
    code, out = dry_run(capsys, ROOT / "examples/models/qwen3-30b-a3b.yaml", "rollout.tensor_parallel_size=3",
                        "rollout.replicas=2", "trainer.engine=megatron", "trainer.parallel.tensor=2",
                        "placement.nodes=2", "placement.devices_per_node=4")
    assert code == 2 and "needs 3 devices on one node" in out


def test_too_few_devices_is_a_config_error_naming_the_key(capsys) -> None:
    code, out = dry_run(capsys, ROOT / "examples/models/qwen3-8b.yaml", "rollout.replicas=8")
    assert code == 2 and "placement.devices_per_node" in out and "needs 12 devices" in out  # trainer 4 + 8


def test_a_plan_that_does_not_fit_fails(capsys) -> None:
    code, out = dry_run(capsys, ROOT / "examples/models/qwen3.6-27b.yaml", "placement.device_memory_gib=48")
    assert code == 2 and "DOES NOT FIT" in out and "placement.device_memory_gib" in out


def test_parallelism_needs_the_megatron_engine() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.parallel:"):
        load_job_config(str(ROOT / "examples/demo.yaml"), ["trainer.parallel.tensor=2"])
    with pytest.raises(ConfigError, match=r"trainer\.parallel\.expert"):
        load_job_config(str(ROOT / "examples/demo.yaml"),
                        ["trainer.engine=megatron", "trainer.parallel.tensor=2", "trainer.parallel.expert=3"])


def test_run_refuses_several_nodes(capsys) -> None:
    code = main(["run", str(ROOT / "examples/models/qwen3.6-27b-multinode.yaml")])
    assert code == 2 and "launcher.kind=ray" in capsys.readouterr().err


def test_device_masks_per_process() -> None:
    cfg = load_job_config(str(ROOT / "examples/models/qwen3-30b-a3b.yaml"), [])
    masks = visible_devices(cfg)
    assert masks["trainer"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert masks["rollout-2"] == {"CUDA_VISIBLE_DEVICES": "5,6"}
    megatron = load_job_config(str(ROOT / "examples/models/qwen3-30b-a3b-megatron.yaml"), [])
    assert visible_devices(megatron)["trainer"] == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert stack_sections(megatron, Path("/tmp/x"))["trainer"]["ranks"] == 2
    single = load_job_config(str(ROOT / "examples/models/qwen3-0.6b.yaml"),
                             ["trainer.device=npu", "rollout.replicas=1"])
    assert visible_devices(single) == {"trainer": {"ASCEND_RT_VISIBLE_DEVICES": "0"},
                                       "rollout": {"ASCEND_RT_VISIBLE_DEVICES": "1"}}
    assert visible_devices(load_job_config(str(ROOT / "examples/demo.yaml"), [])) == {}


def test_a_cpu_trainer_yields_the_cpu_to_generation() -> None:
    """`lorarl run` lowers the priority of the trainer's engine threads only where it shares the CPUs with
    generation; the whole service keeps its priority (its gRPC threads answer the loop at once)."""
    def trainer(path: str, *overrides: str) -> dict:
        return stack_sections(load_job_config(str(ROOT / path), list(overrides)), Path("/tmp/x"))["trainer"]

    assert trainer("examples/demo.yaml")["compute_nice"] == 10
    assert "compute_nice" not in trainer("examples/models/qwen3-0.6b.yaml")
    assert "compute_nice" not in trainer("examples/npu/qwen3-0.6b.yaml")


def test_block_size_reaches_the_rollout_and_must_be_a_multiple_of_16() -> None:
    from lorarl.common.config import from_dict
    from lorarl.rollout.config import RolloutSettings

    demo = load_job_config(str(ROOT / "examples/demo.yaml"), [])
    assert demo.rollout.block_size == 16 and stack_sections(demo, Path("/tmp/x"))["rollout"]["block_size"] == 16
    assert "block_size" not in stack_sections(load_job_config(str(ROOT / "examples/demo.yaml"),
                                                              ["rollout.block_size=0"]), Path("/tmp/x"))["rollout"]
    with pytest.raises(ConfigError, match="block_size"):
        load_job_config(str(ROOT / "examples/demo.yaml"), ["rollout.block_size=24"])
    with pytest.raises(ConfigError, match="block_size"):
        from_dict(RolloutSettings, {"block_size": 24})


def test_lorarl_run_pins_a_cpu_jobs_engine_core_and_trainer_to_halves_of_the_cpus(monkeypatch) -> None:
    """placement.pin_cpus 'auto': in an async loop vLLM's engine core on the first half of the CPUs, the
    trainer on the rest; in a sync loop (they take turns) both on all of them; one OpenMP thread per
    pinned CPU; written into the configs and environments the local stack starts them with; nothing
    pinned when off, for an accelerator trainer, several replicas, or a single CPU."""
    from lorarl.client.launch.services import cpu_pins, local_stack
    from lorarl.common.cpu_affinity import format_cpu_list

    demo = load_job_config(str(ROOT / "examples/demo.yaml"), [])
    sync = load_job_config(str(ROOT / "examples/demo.yaml"), ["loop.mode=sync"])
    for cpus, engine, trainer, threads in (([0, 1], "0", "1", ("1", "1")), ([0, 1, 2, 3, 4], "0-1", "2-4", ("2", "3")),
                                           ([2, 5, 6, 7], "2,5", "6-7", ("2", "2"))):
        monkeypatch.setattr("lorarl.common.cpu_affinity.available_cpus", lambda cpus=cpus: cpus)
        assert cpu_pins(demo) == {"rollout_engine": engine, "trainer": trainer}
        stack = local_stack(demo, Path("/tmp/x"))
        assert stack.sections["rollout"]["engine_cpus"] == engine
        assert stack.server_sections == {"trainer": {"cpus": trainer}}
        assert {p: env["OMP_NUM_THREADS"] for p, env in stack.process_env.items()} == {
            "rollout": threads[0], "trainer": threads[1]}
        assert all((env.get("OMP_WAIT_POLICY") == "PASSIVE") == (env["OMP_NUM_THREADS"] != "1")
                   for env in stack.process_env.values())
        everything = format_cpu_list(cpus)
        assert cpu_pins(sync) == {"rollout_engine": everything, "trainer": everything}
        stack = local_stack(sync, Path("/tmp/x"))
        assert stack.server_sections == {"trainer": {"cpus": everything}}
        assert {p: env["OMP_NUM_THREADS"] for p, env in stack.process_env.items()} == {
            "rollout": str(len(cpus)), "trainer": str(len(cpus))}
    assert cpu_pins(load_job_config(str(ROOT / "examples/demo.yaml"), ["placement.pin_cpus=off"])) == {}
    assert cpu_pins(load_job_config(str(ROOT / "examples/demo.yaml"), ["rollout.replicas=2"])) == {}
    assert cpu_pins(load_job_config(str(ROOT / "examples/models/qwen3-8b.yaml"), [])) == {}
    monkeypatch.setattr("lorarl.common.cpu_affinity.available_cpus", lambda: [3])
    assert cpu_pins(demo) == {}
    stack = local_stack(demo, Path("/tmp/x"))
    assert "engine_cpus" not in stack.sections["rollout"] and stack.server_sections == {} and stack.process_env == {}


def test_the_plan_counts_activations_as_the_engine_will_run_them(capsys) -> None:
    path = ROOT / "examples/models/qwen3-8b.yaml"
    code, out = dry_run(capsys, path)
    assert code == 0 and "checkpointing on (auto)" in out and "micro-batch of 32,768 tokens" in out
    cfg = load_job_config(str(path), [])
    from lorarl.client.job.plan import model_shape, trainer_memory

    shape = model_shape(cfg)
    memory = trainer_memory(cfg, shape, count(shape, 32), free_bytes=72 * 2**30)
    assert memory.step.checkpointing and memory.step.activations < memory.unchecked.activations / 8
    assert memory.total == pytest.approx(memory.static + memory.step.total)


@pytest.mark.parametrize(("overrides", "key"), [
    (["trainer.memory.activation_checkpointing=off"], "trainer.memory.activation_checkpointing"),
    (["trainer.optimizer.micro_batch_tokens=400000"], "trainer.optimizer.micro_batch_tokens"),
    (["placement.device_memory_gib=16"], "placement.device_memory_gib"),
    (["rollout.kv_cache_gib=0.25"], "rollout.kv_cache_gib"),
])
def test_a_plan_that_does_not_fit_is_an_error_naming_the_key(capsys, overrides: list[str], key: str) -> None:
    code, out = dry_run(capsys, ROOT / "examples/models/qwen3-8b.yaml", *overrides)
    assert code == 2, out
    assert f"lorarl: bad config: {key}:" in out and "config OK" not in out


def test_every_real_model_example_is_balanced_by_the_step_time_estimate(capsys) -> None:
    for path in sorted((ROOT / "examples/models").glob("*.yaml")):
        code, out = dry_run(capsys, path)
        if "one-gpu" in path.name:  # co-located on one device: the two halves take turns, nothing to balance
            assert code == 0 and "on the one device, taking turns" in out, f"{path.name}: {out}"
            continue
        assert code == 0 and "step time estimate" in out and ": balanced" in out, f"{path.name}: {out}"


def test_an_unbalanced_split_is_flagged(capsys) -> None:
    code, out = dry_run(capsys, ROOT / "examples/models/qwen3-8b.yaml", "trainer.parallel.data=1",
                        "rollout.replicas=7")
    assert code == 0 and "IMBALANCED" in out
    assert "warning: training takes 6.1x as long" in out and "trainer.parallel.data" in out


def test_the_plan_says_what_one_more_job_on_the_base_costs(capsys) -> None:
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml")
    line = next(x for x in out.splitlines() if x.startswith("trainer, shared:"))
    assert code == 0 and "resident once for every job on it" in line and "each more job like this one adds" in line
    code, out = dry_run(capsys, ROOT / "examples/models/qwen3-30b-a3b-megatron.yaml")
    assert code == 0 and "trainer, shared:" not in out  # the megatron engine keeps a base per job


def test_the_plan_names_every_service_process_of_a_cpu_run(capsys) -> None:
    """#29 item 3: `--dry-run` plans each process `lorarl run` starts (bench/service_memory.py measures them)."""
    from lorarl.client.job.plan import service_plans
    from lorarl.client.job.process_memory import TRAINER_RUNTIME_BYTES

    code, out = dry_run(capsys, ROOT / "examples/demo.yaml")
    assert code == 0
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"), [])
    plans = {p.name: p for p in service_plans(cfg)}
    assert list(plans) == ["trainer", "rollout-0", "rollout-0 engine core", "weightsync"]
    for name, plan in plans.items():
        assert f"  {name}: {human_bytes(plan.total)} (" in out
    assert plans["trainer"].parts["runtime"] == TRAINER_RUNTIME_BYTES
    # the engine core's KV cache is the job's, its LoRA slots the replica's adapters at the serving rank
    core = plans["rollout-0 engine core"].parts
    assert core["KV cache"] == cfg.rollout.kv_cache_gib * (1 << 30) and core["LoRA slots"] > 0
    assert stack_sections(cfg, Path("/tmp/x"))["rollout"]["max_loras"] == cfg.serving_max_loras
    # a merged job's trainer packs the merged weights and its engine core receives them (no LoRA slots)
    merged = {p.name: p.parts for p in service_plans(load_job_config(str(ROOT / "examples/demo.yaml"),
                                                                      ["sync.mode=merged"]))}
    assert "merged payload" in merged["trainer"] and "received bucket" in merged["rollout-0 engine core"]
    assert "LoRA slots" not in merged["rollout-0 engine core"]
    # the engine core holds the rollout's dtype, not the trainer's
    bf16 = {p.name: p.parts for p in service_plans(load_job_config(str(ROOT / "examples/demo.yaml"),
                                                                    ["rollout.dtype=bfloat16"]))}
    key = "weights (vocabulary packed for oneDNN too)"
    assert bf16["rollout-0 engine core"][key] == core[key] / 2
        # two replicas at TP 2: a frontend per replica, an engine process per worker
    wide = service_plans(load_job_config(str(ROOT / "examples/demo.yaml"), [
        "rollout.replicas=2", "rollout.tensor_parallel_size=2"]))
    assert [p.name for p in wide].count("rollout-1 engine core (worker 1)") == 1


def test_the_shared_stack_plans_the_base_once_and_every_jobs_own_part(capsys) -> None:
    """#31: `lorarl run A.yaml B.yaml --dry-run` plans the one stack the jobs share: the trainer holds the base and
    one step's activations once, each job's adapters and Adam and trajectories; the rollout holds every job's
    requests and LoRA slots for all at the largest rank (bench/service_memory.py measures it)."""
    from lorarl.client.job.plan import count, model_shape, service_plans, shared_service_plans, trainer_memory
    from lorarl.client.launch.many_jobs import shared_sections

    files = [str(ROOT / "examples/multitenant/sort.yaml"), str(ROOT / "examples/multitenant/tools.yaml")]
    cfgs = [load_job_config(f, []) for f in files]
    rollout = shared_sections(cfgs, Path("/tmp/x"))["rollout"]
    shared = {p.name: p.parts for p in shared_service_plans(cfgs, rollout)}
    alone = [{p.name: p.parts for p in service_plans(cfg)} for cfg in cfgs]
    memories = [trainer_memory(c, model_shape(c), count(model_shape(c), c.trainer.lora.rank), None) for c in cfgs]
    key = "weights, adapters, Adam and step"
    assert shared["trainer"][key] == pytest.approx(
        memories[0].weights + sum(m.adapters + m.adam for m in memories) + max(m.step.total for m in memories))
    assert shared["trainer"][key] < sum(a["trainer"][key] for a in alone) - memories[0].weights  # base once
    for process, part in (("trainer", "trajectories"), ("rollout-0", "requests in flight")):
        assert shared[process][part] == pytest.approx(sum(a[process][part] for a in alone))
    # the slots of both jobs' windows at the larger rank: more than either job's own rollout holds
    assert shared["rollout-0 engine core"]["LoRA slots"] > max(a["rollout-0 engine core"]["LoRA slots"] for a in alone)
    assert list(shared) == list(alone[0])
    assert main(["run", *files, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "the shared stack's processes (peak resident memory" in out
    assert f"  trainer: {human_bytes(sum(shared['trainer'].values()))} (" in out


def test_vllm_on_cpu_holds_a_tied_vocabulary_three_times_and_an_untied_one_four() -> None:
    from lorarl.client.job.process_memory import engine_core_weights, lora_slot_bytes, vocab_bytes

    tied = dict(KNOWN_SHAPES["qwen3-0.6b"])
    untied = {**tied, "tie_word_embeddings": False}
    vocab = vocab_bytes(tied, "float32")
    assert vocab == 151936 * 1024 * 4
    layers = count(tied, 8)["base"] * 4 - vocab
    assert engine_core_weights(tied, count(tied, 8), "float32", 1) == layers + 3 * vocab
    assert engine_core_weights(untied, count(untied, 8), "float32", 1) == layers + 4 * vocab
    assert engine_core_weights(tied, count(tied, 8), "float32", 2) == (layers + 3 * vocab) / 2
    # per slot: the adapter at the serving rank, and vocabulary-wide A and B (measured in vLLM 0.32's CPU buffers)
    assert lora_slot_bytes(tied, 1000, 32, 4, "float32") == 4 * (1000 * 4 + 2 * 151936 * 32 * 4)


def test_an_accelerator_run_says_its_host_memory_is_not_planned(capsys) -> None:
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml", "trainer.device=cuda")
    assert code == 0 and "processes: host memory per process is planned for CPU runs with vLLM only" in out


def test_a_co_located_job_plans_one_base_copy_and_refuses_what_would_write_it_at_the_dry_run(capsys) -> None:
    """#44: placement.colocate shares one base; what would write it, or need a second copy, is refused up front."""
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml", "placement.colocate=true")
    assert code == 0 and "co-located: ONE copy of the base" in out
    # the engine core maps the shared copy, unpacked (no oneDNN copies of the vocabulary); the stack counts it once
    assert "shared base (mapped, unpacked" in out and "oneDNN" not in out and "the shared base counted once" in out
    sections = stack_sections(load_job_config(str(ROOT / "examples/demo.yaml"), ["placement.colocate=true"]),
                              Path("/tmp/x"))
    assert sections["trainer"]["collective"] is False  # handoffs are memory files: no gloo group for them
    refused = {
        "sync.mode=merged": "written into the base the trainer computes on",
        "rollout.replicas=2": "one vLLM replica at tensor parallel size 1",
        "rollout.dtype=bfloat16": "one copy has one dtype",
    }
    for override, why in refused.items():
        code, out = dry_run(capsys, ROOT / "examples/demo.yaml", "placement.colocate=true", override)
        assert code == 2 and "placement.colocate" in out and why in out, (override, out)
    # what only the plan knows: a MoE model on vLLM CPU has no LoRA, so every version would be merged into it
    code, out = dry_run(capsys, ROOT / "examples/moe-merged.yaml", "placement.colocate=true", "sync.mode=adapter")
    assert code == 2 and "would serve no LoRA" in out and "co-located: ONE" not in out
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml", "placement.colocate=true", "model.dtype=bfloat16")
    assert code == 2 and "set model.dtype to the checkpoint's" in out
    # an adapter above the engine's rank would be merged locally: refused before anything starts
    code, out = dry_run(capsys, ROOT / "examples/demo.yaml", "placement.colocate=true", "trainer.lora.rank=32",
                        "rollout.max_lora_rank=16")
    assert code == 2 and "rollout.max_lora_rank" in out


def test_one_card_jobs_plan_the_base_once_per_device_and_say_what_is_not_started(capsys) -> None:
    """#44 step 3: Qwen3-8B and Qwen3.6-27B LoRA RL on ONE 80 GB GPU, co-located: one budget for the device, the
    base counted once; two copies of the 27B base could not start there. CUDA co-location is a plan only:
    `lorarl run` says so instead of starting services; Ascend is refused."""
    for name, base in (("qwen3-8b-one-gpu.yaml", "15.3 GiB"), ("qwen3.6-27b-one-gpu.yaml", "51.7 GiB")):
        code, out = dry_run(capsys, ROOT / "examples/models" / name)
        assert code == 0, out
        assert "node 0: trainer (device 0), rollout-0 (device 0)" in out
        assert re.search(rf"base, ONE copy \(trainer and rollout\) +{base}", out), out
        total = re.search(r"total, all resident at once +([\d.]+) GiB: fits", out)
        separate = re.search(r"separate copies would need ([\d.]+) GiB", out)
        assert total and separate and float(separate.group(1)) - float(total.group(1)) == pytest.approx(
            float(base.split()[0]), abs=0.15)
        assert "context: the KV cache holds" in out
    code, out = dry_run(capsys, ROOT / "examples/models/qwen3.6-27b-one-gpu.yaml", "rollout.kv_cache_gib=24")
    assert code == 2 and "DOES NOT FIT" in out and "co-located, the device needs" in out
    code, out = dry_run(capsys, ROOT / "examples/models/qwen3.6-27b-one-gpu.yaml", "placement.colocate=false")
    assert code == 2 and "the job needs 2 devices" in out  # apart, the one card cannot hold both services
    code = main(["run", str(ROOT / "examples/models/qwen3-8b-one-gpu.yaml")])
    captured = capsys.readouterr()
    assert code == 2 and "placement.colocate: on CUDA it is planned" in captured.err
    assert "bench/one_base_gpu.py" in captured.err
    code, out = dry_run(capsys, ROOT / "examples/npu/qwen3-0.6b.yaml", "placement.colocate=true")
    assert code == 2 and "on Ascend each service loads its own copy" in out
