"""On-policy distillation in the job file (#47): distill.teachers checked with the loss that reads them, each
teacher a PEFT adapter read and routed by a data column, the plan's lines (a teacher not there yet is a warning
naming what makes it), the rollout sized for the teachers, and the loop's routing, episodes and per-teacher
metrics."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from lorarl.client.job.config import load_job_config
from lorarl.client.job.datasets import Example
from lorarl.client.job.inputs import check_inputs, distill_lines, job_teachers, teacher_routes
from lorarl.client.launch.services import stack_sections
from lorarl.client.rl.loop import distill_stats
from lorarl.client.workflow.api import Episode, Sampled
from lorarl.common.config import ConfigError
from lorarl.contract.lora import LoraSpec
from lorarl.contract.peft import tensor_name, write_peft_files
from lorarl.contract.staleness import adapter_window

ROOT = Path(__file__).resolve().parents[3]
STUDENT = ROOT / "examples" / "distill" / "two-tasks" / "student.yaml"


def teacher_dir(folder: Path, rank: int = 16) -> Path:
    """A PEFT adapter directory of ``rank`` on the shipped tiny model's q_proj (what a teacher is read from)."""
    tensors = {tensor_name("model.layers.0.self_attn.q_proj", "A"): torch.zeros(rank, 128),
               tensor_name("model.layers.0.self_attn.q_proj", "B"): torch.zeros(128, rank)}
    return write_peft_files(folder, tensors, LoraSpec(rank=rank).peft_config("tiny", ["q_proj"]))


def student(tmp_path: Path, sort: str, add: str, **changes: object) -> Path:
    """examples/distill/two-tasks/student.yaml with its teachers at ``sort`` and ``add`` (and top-level ``changes``)."""
    raw = yaml.safe_load(STUDENT.read_text())
    raw["model"]["path"] = str(ROOT / raw["model"]["path"])
    raw["distill"]["teachers"][0]["adapter"], raw["distill"]["teachers"][1]["adapter"] = sort, add
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    job = tmp_path / "student.yaml"
    job.write_text(yaml.safe_dump(raw))
    return job


def test_teachers_are_read_routed_by_the_task_column_and_size_the_rollout(tmp_path: Path) -> None:
    sort, add = teacher_dir(tmp_path / "sort", rank=16), teacher_dir(tmp_path / "add", rank=8)
    cfg = load_job_config(str(student(tmp_path, str(sort), str(add))), [])
    teachers = job_teachers(cfg)
    assert [(t.name, t.lora.rank, t.domain) for t in teachers] == [("sort", 16, "sort"), ("add", 8, "add")]
    assert teachers[0].job_id("student") == "student.teacher.sort"
    rows = [Example("sort 21", "12", {"task": "sort"}), Example("1+1=", "2", {"task": "add"}),
            Example("sort 31", "13", {"task": "sort"})]
    assert teacher_routes(cfg, rows) == {"sort": 2, "add": 1}
    with pytest.raises(ConfigError, match=r"distill\.route_key: train row 1 has task='mul'"):
        teacher_routes(cfg, [Example("2*2=", "4", {"task": "mul"})])
    # the rollout holds the student's window and one slot per teacher, at the largest rank of all
    rollout = stack_sections(cfg, tmp_path)["rollout"]
    assert rollout["max_lora_rank"] == 16 and rollout["max_loras"] == cfg.serving_max_loras
    assert cfg.serving_max_loras == max(cfg.rollout.max_loras, adapter_window(cfg.loop.max_staleness) + 1) + 2
    assert stack_sections(cfg, tmp_path)["trainer"]["max_jobs"] == 6
    assert rollout["long_prefill_tokens"] == 32  # teachers' rows prefilled in pieces (bench/distill_memory.py)
    plain = load_job_config(str(ROOT / "examples" / "demo.yaml"), [])
    assert "long_prefill_tokens" not in stack_sections(plain, tmp_path)["rollout"]
    lines = check_inputs(cfg)
    assert any(line.startswith(f"teacher sort: {sort} (rank 16), route domain task=sort, 7500 of 15000")
               for line in lines), lines


def test_a_teacher_not_trained_yet_is_a_warning_naming_its_command_and_lorarl_run_refuses_it(tmp_path: Path) -> None:
    cfg = load_job_config(str(student(tmp_path, str(tmp_path / "nowhere"), str(teacher_dir(tmp_path / "add")))), [])
    lines = check_inputs(cfg, missing_ok=True)
    warning = lines.index(next(line for line in lines if line.startswith("WARNING distill.teachers[0].adapter")))
    assert lines[warning + 1] == "  hint: make it with: lorarl run examples/distill/two-tasks/expert-sort.yaml"
    with pytest.raises(ConfigError, match="no adapter at"):
        check_inputs(cfg)


@pytest.mark.parametrize(("changes", "key", "words"), [
    ({"trainer__loss": {"type": "grpo"}, "rollout__group_size": 4}, "trainer.loss.type", "does not read the 2 teacher"),
    ({"sync__mode": "merged"}, "sync.mode", "need sync.mode adapter"),
    ({"distill__route_key": "task", "distill__route": "domain", "distill__teachers": [
        {"name": "a", "adapter": "x", "domain": "sort"}, {"name": "a", "adapter": "y", "domain": "add"}]},
     "distill.teachers[1].name", "names teacher 0 too"),
    ({"distill__teachers": [{"name": "a", "adapter": "x", "domain": "sort"},
                            {"name": "b", "adapter": "y", "domain": "sort"}]}, "distill.teachers", "share a domain"),
    ({"distill__teachers": [{"name": "a", "adapter": "x"}]}, "distill.teachers[0].domain", "is empty"),
    ({"distill__teachers": []}, "distill.teachers", "is empty, but trainer.loss"),
])
def test_what_a_distillation_job_file_refuses(tmp_path: Path, changes: dict, key: str, words: str) -> None:
    job = student(tmp_path, "a", "b", **changes)
    with pytest.raises(ConfigError) as refused:
        load_job_config(str(job), [])
    assert refused.value.key == key and words in str(refused.value)


def test_the_shipped_student_plans_on_a_fresh_clone(tmp_path: Path) -> None:
    """Before its experts are trained the student's dry run exits 0 with one warning per missing teacher."""
    from lorarl.client.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["run", str(STUDENT), "--dry-run"])
    text = out.getvalue()
    assert code == 0 and "teacher sort:" in text and "teacher add:" in text


def sampled(tokens: int, behaviour: float, teacher: float | None) -> Sampled:
    return Sampled(list(range(tokens)), [behaviour] * tokens, [1] * tokens,
                   teacher_logprobs=None if teacher is None else [teacher] * tokens)


def test_an_episode_carries_its_teachers_logprobs_over_its_policy_turns_only() -> None:
    episode = Episode([1, 2])
    episode.add_policy(sampled(2, -1.0, -0.5))
    episode.add_context([7, 7, 7])
    episode.add_policy(sampled(1, -2.0, -0.25))
    episode.teacher = "sort"
    proto = episode.to_proto("student", "t", "g")
    assert list(proto.teacher_logprobs) == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.25] and proto.teacher == "sort"
    with pytest.raises(ValueError, match="all scored by teachers or none"):
        episode.add_policy(sampled(1, -1.0, None))
    plain = Episode([1])
    plain.add_policy(sampled(2, -1.0, None))
    assert not plain.to_proto("student", "t", "g").teacher_logprobs


def test_the_loop_reports_each_teachers_reverse_kl_reward_and_share() -> None:
    def scored(teacher: str, behaviour: float, logp: float, reward: float) -> Episode:
        e = Episode([1])
        e.add_policy(sampled(2, behaviour, logp))
        e.teacher, e.reward = teacher, reward
        return e

    groups = [[scored("sort", -1.0, -0.5, 1.0), scored("sort", -2.0, -0.5, 0.0)],
              [scored("add", -1.0, -1.25, 1.0)], [scored("sort", -1.0, -1.0, 1.0)]]
    stats = distill_stats(groups, 1.5)
    assert stats["distill/teacher_seconds"] == 1.5
    assert stats["distill/sort/reverse_kl"] == pytest.approx((-0.5 * 2 - 1.5 * 2 + 0.0 * 2) / 6)
    assert stats["distill/add/reverse_kl"] == pytest.approx(0.25)
    assert stats["distill/sort/reward_mean"] == pytest.approx(2 / 3)
    assert stats["distill/sort/prompt_share"] == pytest.approx(2 / 3)
    assert distill_stats([[Episode([1])]], 0.0) == {}
    json.dumps(stats)


def adapter_of(folder: Path, module: str, a: tuple[int, int], b: tuple[int, int], base: str) -> Path:
    """A PEFT directory holding one module's halves of the given shapes, naming ``base`` as its base."""
    tensors = {tensor_name(module, "A"): torch.zeros(*a), tensor_name(module, "B"): torch.zeros(*b)}
    return write_peft_files(folder, tensors, LoraSpec(rank=a[0]).peft_config(base, [module.rsplit(".", 1)[-1]]))


def test_a_teacher_trained_on_another_base_is_refused_naming_both(tmp_path: Path) -> None:
    """A teacher adapter whose modules or shapes miss the job's base (another model's expert) is refused at the
    dry run, naming the base it was trained on and the job's."""
    add = str(teacher_dir(tmp_path / "add"))
    wide = adapter_of(tmp_path / "wide", "model.layers.0.self_attn.q_proj", (8, 256), (256, 8), "Qwen/Qwen3-8B")
    with pytest.raises(ConfigError) as refused:
        job_teachers(load_job_config(str(student(tmp_path, str(wide), add)), []))
    message = str(refused.value)
    assert refused.value.key == "distill.teachers[0].adapter" and "'Qwen/Qwen3-8B'" in message
    assert "qwen3-tiny" in message and "model.layers.0.self_attn.q_proj: lora_A [8, 256]" in message
    moe = adapter_of(tmp_path / "moe", "model.layers.0.mlp.experts.0.up_proj", (8, 128), (128, 8), "moe")
    with pytest.raises(ConfigError, match=r"experts\.0\.up_proj is not a linear layer of the base"):
        job_teachers(load_job_config(str(student(tmp_path, str(moe), add)), []))


def model_copy(folder: Path, extra_token: str = "") -> Path:
    """The shipped tiny model's files in ``folder`` (weights linked); with ``extra_token``, its tokenizer gains that
    token: another id mapping."""
    source = ROOT / "lorarl" / "assets" / "models" / "qwen3-tiny"
    folder.mkdir(parents=True)
    for file in source.iterdir():
        (folder / file.name).symlink_to(file)
    if extra_token:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source))
        tokenizer.add_tokens([extra_token])
        for file in folder.glob("*token*"):
            file.unlink()
        tokenizer.save_pretrained(str(folder))
    return folder


def test_a_full_model_teacher_runs_on_an_engine_of_its_own(tmp_path: Path) -> None:
    """distill.teachers[].model: a full model with the job's tokenizer, no adapter slot on the student's rollout, its
    own engine section (the student's rollout settings for its model, without LoRA), the plan saying so."""
    from lorarl.client.launch.services import teacher_engine_sections

    sort, add = teacher_dir(tmp_path / "sort"), model_copy(tmp_path / "add-model")
    job = student(tmp_path, str(sort), "")
    raw = yaml.safe_load(job.read_text())
    raw["distill"]["teachers"][1] = {"name": "add", "model": str(add), "domain": "add"}
    job.write_text(yaml.safe_dump(raw))
    cfg = load_job_config(str(job), [])
    sort_teacher, add_teacher = job_teachers(cfg)
    assert not sort_teacher.own_engine and add_teacher.own_engine and add_teacher.path == str(add.resolve())
    assert add_teacher.policy("student").engine == "add" and not add_teacher.policy("student").job_id
    assert sort_teacher.policy("student").job_id == "student.teacher.sort"
    assert cfg.serving_max_loras == max(cfg.rollout.max_loras, adapter_window(cfg.loop.max_staleness) + 1) + 1
    rollout = stack_sections(cfg, tmp_path)["rollout"]
    (engine,) = teacher_engine_sections(cfg, rollout).values()
    assert engine["model_path"] == str(add.resolve()) and engine["enable_lora"] is False
    assert engine["replica_id"] == "teacher-add" and "max_loras" not in engine and "openai_port" not in engine
    assert engine["max_num_seqs"] == rollout["max_num_seqs"] and engine["dtype"] == rollout["dtype"]
    lines = distill_lines(cfg, [], missing_ok=False)
    assert lines[1].startswith(f"teacher add: {add.resolve()} (a full model on an engine of its own"), lines


def test_a_full_model_teacher_with_another_tokenizer_is_refused_at_the_dry_run_naming_both(tmp_path: Path) -> None:
    from lorarl.client.cli import main

    other = model_copy(tmp_path / "other-model", extra_token="<|teacher-only|>")
    job = student(tmp_path, str(teacher_dir(tmp_path / "sort")), "")
    raw = yaml.safe_load(job.read_text())
    raw["distill"]["teachers"][1] = {"name": "add", "model": str(other), "domain": "add"}
    job.write_text(yaml.safe_dump(raw))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", str(job), "--dry-run"])
    text = out.getvalue() + err.getvalue()
    assert code != 0 and "distill.teachers[1].model" in text, text
    assert str(other.resolve()) in text and "qwen3-tiny" in text and "do not read token ids alike" in text, text
    assert "'<|teacher-only|>'" in text, text  # the first id that maps differently, by name


@pytest.mark.parametrize(("teacher", "changes", "words"), [
    ({"name": "add", "adapter": "x", "model": "y", "domain": "add"}, {}, "set exactly one"),
    ({"name": "add", "domain": "add"}, {}, "set exactly one"),
    ({"name": "add", "model": "y", "domain": "add"}, {"launcher__kind": "ray"}, "local launcher only"),
    ({"name": "add", "model": "y", "domain": "add"}, {"trainer__device": "cuda"}, "CPU hosts only"),
])
def test_what_a_full_model_teacher_refuses(tmp_path: Path, teacher: dict, changes: dict, words: str) -> None:
    job = student(tmp_path, "a", "b", **changes)
    raw = yaml.safe_load(job.read_text())
    raw["distill"]["teachers"][1] = teacher
    job.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as refused:
        load_job_config(str(job), [])
    assert refused.value.key.startswith("distill.teachers[1]") and words in str(refused.value), refused.value


def test_the_launchers_that_do_not_start_a_teachers_engine_refuse_a_full_model_teacher(tmp_path: Path) -> None:
    """A Slurm script and a stack several jobs share would start no engine for it: refused by its key, not left
    for the student's rollout to refuse mid-run."""
    from lorarl.client.launch import slurm
    from lorarl.client.launch.many_jobs import check_shareable

    job = student(tmp_path, "a", "b")
    raw = yaml.safe_load(job.read_text())
    raw["distill"]["teachers"][1] = {"name": "add", "model": "y", "domain": "add"}
    job.write_text(yaml.safe_dump(raw))
    cfg = load_job_config(str(job), [])
    with pytest.raises(ConfigError, match="Slurm script does not start") as refused:
        slurm.write(cfg, str(job), [], tmp_path / "job.sbatch")
    assert refused.value.key == "distill.teachers[1].model" and not (tmp_path / "job.sbatch").exists()
    with pytest.raises(ConfigError, match="not on a stack several jobs share") as refused:
        check_shareable([cfg])
    assert refused.value.key == "distill.teachers[1].model"
    from lorarl.client.launch.attach import check_attachable

    owner = tmp_path / "owner-run"
    owner.mkdir()
    (owner / "config.json").write_text(json.dumps({"job_id": "owner"}))
    with pytest.raises(ConfigError, match="not for a job that attaches") as refused:
        check_attachable(cfg, owner)
    assert refused.value.key == "distill.teachers[1].model"


def version_student(tmp_path: Path, job: str = "expert-add@v40", **changes: object) -> Path:
    """The example's student with its add teacher another job's version, ``job``."""
    path = student(tmp_path, str(teacher_dir(tmp_path / "sort")), "b", **changes)
    raw = yaml.safe_load(path.read_text())
    raw["distill"]["teachers"][1] = {"name": "add", "job": job, "domain": "add"}
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_teacher_that_is_another_jobs_version_is_planned_for_the_stack_it_attaches_to(tmp_path: Path) -> None:
    """JOB@vN is read from the stack's weight sync when the run starts: the plan says so, and a run that starts a
    stack of its own (which holds no other job's versions) is refused by the teacher's key — at --dry-run too —
    as are a Slurm script and several jobs started together."""
    from lorarl.client.cli import main
    from lorarl.client.launch import slurm
    from lorarl.client.launch.many_jobs import check_shareable
    from lorarl.client.launch.services import check_startable

    job = version_student(tmp_path)
    cfg = load_job_config(str(job), [])
    sort, add = job_teachers(cfg)
    assert add.version_of == ("expert-add", 40) and not add.own_engine and add.lora is None
    assert sort.version_of is None and sort.lora is not None
    lines = check_inputs(cfg)
    assert any(line.startswith("teacher add: expert-add v40 (another job's version, read from the stack's weight "
                               "sync when the run starts), route domain task=add") for line in lines), lines
    assert stack_sections(cfg, tmp_path)["trainer"]["max_jobs"] == 6  # the student, 2 teachers, room beside
    for refuse in (check_startable, check_shareable, lambda c: slurm.write(c, str(job), [], tmp_path / "j.sbatch")):
        with pytest.raises(ConfigError, match="--attach RUN_DIR") as refused:
            refuse(cfg if refuse is not check_shareable else [cfg])
        assert refused.value.key == "distill.teachers[1].job"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["run", str(job), "--dry-run"])
    assert code == 2 and "distill.teachers[1].job" in out.getvalue() and "--attach" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize(("job", "teacher", "words"), [
    ("expert-add@v0", {}, "JOB@vN"),
    ("expert-add", {}, "JOB@vN"),
    ("expert add@v3", {}, "JOB@vN"),
    ("expert-add@v3", {"adapter": "x"}, "set exactly one"),
    ("x" * 65 + "@v3", {}, "JOB@vN"),  # longer than any job id
    ("student@v3", {}, "this job's own version"),
])
def test_what_a_job_version_teacher_refuses(tmp_path: Path, job: str, teacher: dict, words: str) -> None:
    path = version_student(tmp_path, job)
    raw = yaml.safe_load(path.read_text())
    raw["distill"]["teachers"][1].update(teacher)
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as refused:
        load_job_config(str(path), [])
    assert refused.value.key.startswith("distill.teachers[1]") and words in str(refused.value), refused.value


def test_pure_distillation_samples_one_completion_per_prompt_and_a_reward_mix_needs_a_group(tmp_path: Path) -> None:
    """opd reads no group (each token's advantage its reverse KL to the teacher): group_size 1 is accepted; with the
    reward's group advantage mixed in (rl_weight), one sample per prompt would give it nothing: refused."""
    sort, add = str(teacher_dir(tmp_path / "sort")), str(teacher_dir(tmp_path / "add"))
    cfg = load_job_config(str(student(tmp_path, sort, add, rollout__group_size=1)), [])
    assert cfg.rollout.group_size == 1 and cfg.trainer.loss.reward_scale == 0
    mixed = student(tmp_path, sort, add, rollout__group_size=1, trainer__loss={"type": "opd", "rl_weight": 1.0})
    with pytest.raises(ConfigError, match=r"is 1 with trainer\.loss\.type 'opd'") as refused:
        load_job_config(str(mixed), [])
    assert refused.value.key == "rollout.group_size"

