"""Several jobs on one stack (lorarl.client.launch.many_jobs): which jobs can share the services and how the
rollout is sized for all of them; the shipped tasks chosen per job; `lorarl run A B` reading its job files
before its overrides."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lorarl.client.commands.run import job_files
from lorarl.client.job.config import load_job_config
from lorarl.client.job.inputs import job_examples
from lorarl.client.launch.many_jobs import check_shareable, shared_sections
from lorarl.client.launch.services import stack_sections
from lorarl.common.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "multitenant"


def example(name: str, *overrides: str):
    return load_job_config(str(EXAMPLE / f"{name}.yaml"), list(overrides))


def test_the_examples_jobs_share_a_stack_sized_for_both(tmp_path: Path) -> None:
    tools, sort = example("tools"), example("sort", "loop.max_staleness=1", "rollout.max_model_len=4096")
    check_shareable([tools, sort])
    rollout = shared_sections([tools, sort], tmp_path)["rollout"]
    alone = stack_sections(tools, tmp_path)["rollout"]
    # adapter slots for each job's staleness window, the larger rank, both batches in one wave
    assert rollout["max_loras"] == (2 + 2 + 1) + (1 + 2 + 1) and rollout["adapter_window"] == 4
    assert rollout["max_lora_rank"] == 16 > alone["max_lora_rank"]
    assert rollout["max_num_seqs"] == 2 * alone["max_num_seqs"]
    assert rollout["max_model_len"] == 4096 > alone["max_model_len"]
    # a shared rollout: nothing is ever merged over the base both jobs sample from (lorarl.contract.sharing)
    assert rollout["shared"] is True and "shared" not in alone
    sized = ("max_loras", "adapter_window", "max_lora_rank", "max_num_seqs", "max_model_len", "shared")
    assert {k: v for k, v in rollout.items() if k not in sized} == {k: v for k, v in alone.items() if k not in sized}
    # the Tinker front's rollout: the same formula for one job, serving at least the SDK's default rank
    assert shared_sections([tools], tmp_path, min_rank=32)["rollout"]["max_lora_rank"] == 32
    assert shared_sections([tools], tmp_path, min_rank=20)["rollout"]["max_lora_rank"] == 32


@pytest.mark.parametrize(("override", "message"), [
    ("model.dtype=bfloat16", "model.dtype: jobs tools and sort differ"),
    ("rollout.engine=hf", "rollout.engine: jobs tools and sort differ"),
    ("sync.mode=merged", "job sort: a merged job's versions replace the base weights every other job"),
    ("rollout.replicas=2", "rollout.replicas: jobs tools and sort differ"),
    ("job_id=tools", "two jobs have job_id 'tools'"),
    ("launcher.kind=ray", "on this host only"),
])
def test_jobs_that_cannot_share_are_refused_naming_the_setting(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_shareable([example("tools"), example("sort", override)])


def test_a_rollout_without_lora_cannot_be_shared_and_one_jobs_plan_says_it_merges_locally(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped MoE on vLLM's CPU backend runs no LoRA: alone, an adapter job's plan says each version is merged
    locally on its replica and why; two such jobs on one stack are refused (it would merge one job's adapter over
    the base the other samples from)."""
    from lorarl.client.cli import main

    moe = ["model.path=lorarl/assets/models/qwen3-moe-tiny", "sync.mode=adapter", "trainer.device=cpu"]
    first, second = example("tools", *moe), example("sort", *moe)
    with pytest.raises(ConfigError, match=r"rollout.enable_lora: job tools: this rollout is shared by several jobs "
                                          r"and its engine \(vllm\) does not support LoRA"):
        check_shareable([first, second])
    assert main(["run", str(ROOT / "examples/moe-merged.yaml"), "--dry-run", "sync.mode=adapter"]) == 0
    assert "adapter (sync.mode), merged locally on each replica because" in capsys.readouterr().out


def test_each_job_trains_and_evaluates_on_its_own_shipped_task() -> None:
    for name in ("tools", "sort"):
        cfg = example(name)
        for split in ("train", "test"):
            examples = job_examples(cfg, split)
            assert examples and all((e.prompt.startswith("sort ")) == (name == "sort") for e in examples)
    with pytest.raises(ConfigError, match="unknown task 'mul'"):
        example("sort", "data.tasks=[mul]")
    with pytest.raises(ConfigError, match=r"data\.source=tasks"):
        example("sort", "data.source=jsonl", "data.train_path=a.jsonl", "data.test_path=b.jsonl")


def test_run_reads_its_job_files_before_the_overrides() -> None:
    args = argparse.Namespace(config="a.yaml", overrides=["b.yaml", "c.yaml", "loop.steps=2", "x.y=1"])
    assert job_files(args) == ["a.yaml", "b.yaml", "c.yaml"] and args.overrides == ["loop.steps=2", "x.y=1"]
    with pytest.raises(ConfigError, match="before the key=value overrides"):
        job_files(argparse.Namespace(config="a.yaml", overrides=["loop.steps=2", "b.yaml"]))
    with pytest.raises(ConfigError, match=r"'loop.steps' is neither a job file nor a key=value override \(an "
                                          r"override is written loop.steps=VALUE\)"):
        job_files(argparse.Namespace(config="a.yaml", overrides=["loop.steps", "8"]))


def test_dry_run_checks_each_job_and_that_they_can_share(capsys: pytest.CaptureFixture[str]) -> None:
    from lorarl.client.cli import main

    files = [str(EXAMPLE / "sort.yaml"), str(EXAMPLE / "tools.yaml")]
    assert main(["run", *files, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("config OK") == 2 and "jobs sort, tools can share one stack" in out
    assert main(["run", *files, "--dry-run", "sync.mode=merged"]) == 2
    assert "a merged job's versions replace the base weights" in capsys.readouterr().err
