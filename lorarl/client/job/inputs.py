"""A job's own inputs — its data, reward and workflow — found from the job file (its folder first) and
checked before any service starts (`lorarl run --dry-run` reads a few rows of each split, imports the
reward and builds the workflow: a missing file or a bad reward fails there, not a minute into the run)."""

from __future__ import annotations

import sys

from lorarl.client.job.config import JobFileConfig, job_path
from lorarl.client.job.datasets import Example, load_examples
from lorarl.client.job.rewards import RewardFn, load_reward
from lorarl.client.workflow import Workflow, load_workflow
from lorarl.common.config import ConfigError
from lorarl.contract.peft_files import read_peft_config

#: Rows of each split --dry-run reads.
PEEK_ROWS = 3


def job_examples(cfg: JobFileConfig, split: str, limit: int | None = None) -> list[Example]:
    """The train or test split's examples (``limit``: only the first rows)."""
    d = cfg.data
    path = job_path(cfg, d.train_path if split == "train" else d.test_path)
    return load_examples(d.source, split, path, d.columns, d.train_split if split == "train" else d.test_split,
                         limit=limit, tasks=d.tasks)


def job_reward(cfg: JobFileConfig) -> RewardFn:
    return load_reward(cfg.data.reward, getattr(cfg, "job_dir", ""))


def job_workflow(cfg: JobFileConfig) -> Workflow:
    return load_workflow(cfg.workflow.name, cfg.workflow.settings, getattr(cfg, "job_dir", ""))


def check_warm_start(cfg: JobFileConfig) -> str:
    """trainer.init_adapter: a PEFT LoRA directory the job's LoRA section matches; its path, or ConfigError."""
    path = job_path(cfg, cfg.trainer.init_adapter)
    if cfg.trainer.engine != "torch":
        raise ConfigError("trainer.init_adapter", "a warm start needs trainer.engine=torch (Megatron cannot load "
                                                  "a PEFT adapter yet)")
    try:
        config = read_peft_config(path)
    except ValueError as e:
        raise ConfigError("trainer.init_adapter", str(e)) from None
    problems = cfg.trainer.lora.spec().warm_start_problems(config)
    if problems:
        raise ConfigError("trainer.init_adapter", f"{path}: " + "; ".join(problems))
    return path


def check_inputs(cfg: JobFileConfig) -> list[str]:
    """Reads the first rows of both splits, imports the reward, builds the workflow; raises ConfigError
    naming the key at the first problem, else returns one line per input for the plan."""
    lines = []
    for split in ("train", "test"):
        rows = job_examples(cfg, split, limit=PEEK_ROWS)
        columns = sorted(rows[0].columns)
        kind = "chat" if isinstance(rows[0].prompt, list) else "text"
        where = job_path(cfg, cfg.data.train_path if split == "train" else cfg.data.test_path) or "(shipped tasks)"
        lines.append(f"data {split}: {cfg.data.source} {where}, {kind} prompts, columns {columns}")
    job_reward(cfg)
    lines.append(f"reward: {cfg.data.reward}")
    if cfg.trainer.init_adapter:
        lines.append(f"warm start: {check_warm_start(cfg)}")
    workflow = job_workflow(cfg)
    lines.append(f"workflow: {cfg.workflow.name} ({type(workflow).__module__}.{type(workflow).__qualname__})")
    return lines


def inputs_ok(cfg) -> bool:
    """The job's plan (the model's shape, targets that adapt something, memory that fits: what `--dry-run`
    checks) and its data, reward, workflow and warm-start adapter, checked before any service starts; what is
    wrong goes to stderr."""
    import contextlib
    import io

    from lorarl.client.job.plan import print_plan

    plan = io.StringIO()
    with contextlib.redirect_stdout(plan):
        code = print_plan(cfg)
    if code:
        print(plan.getvalue(), end="", file=sys.stderr)
        return False
    try:
        check_inputs(cfg)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return False
    return True
