"""A job's own inputs — its data, reward and workflow — found from the job file (its folder first) and
checked before any service starts (`lorarl run --dry-run` reads every row of each split and measures its
prompt against data.max_prompt_tokens, imports the reward and builds the workflow: a missing file, a bad row or
a bad reward fails there, not a minute into the run)."""

from __future__ import annotations

import sys

from lorarl.client.job.config import JobFileConfig, job_path
from lorarl.client.job.datasets import Example, load_examples
from lorarl.client.job.rewards import RewardFn, load_reward
from lorarl.client.workflow import Workflow, load_workflow
from lorarl.common.config import ConfigError
from lorarl.contract.chat import ChatRenderer
from lorarl.contract.peft_files import read_peft_config


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


def prompt_renderer(cfg: JobFileConfig) -> ChatRenderer | None:
    """The loop's renderer for this job's prompts, or None where model.path holds no tokenizer (a plan-only
    model: its prompts cannot be measured here)."""
    from pathlib import Path

    root = Path(cfg.model.path)
    if not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    d = cfg.data
    return ChatRenderer(cfg.model.path, chat_template=d.chat_template, system_prompt=d.system_prompt,
                        enable_thinking=d.enable_thinking)


def check_inputs(cfg: JobFileConfig) -> list[str]:
    """Reads every row of both splits (their count said), measures each prompt as the loop renders it against
    data.max_prompt_tokens, imports the reward, builds the workflow; raises ConfigError naming the key at the
    first problem, else returns one line per input for the plan."""
    lines = []
    renderer = prompt_renderer(cfg)
    for split in ("train", "test"):
        rows = job_examples(cfg, split)
        if not rows:
            raise ConfigError(f"data.{split}_path", f"the {split} split has no rows")
        columns = sorted(rows[0].columns)
        kind = "chat" if isinstance(rows[0].prompt, list) else "text"
        where = job_path(cfg, cfg.data.train_path if split == "train" else cfg.data.test_path) or "(shipped tasks)"
        lines.append(f"data {split}: {cfg.data.source} {where}, {len(rows)} rows, {kind} prompts, columns "
                     f"{columns}{prompt_lengths(cfg, renderer, rows, split)}")
    job_reward(cfg)
    lines.append(f"reward: {cfg.data.reward}")
    if cfg.trainer.init_adapter:
        lines.append(f"warm start: {check_warm_start(cfg)}")
    workflow = job_workflow(cfg)
    lines.append(f"workflow: {cfg.workflow.name} ({type(workflow).__module__}.{type(workflow).__qualname__})")
    return lines


def prompt_lengths(cfg: JobFileConfig, renderer: ChatRenderer | None, rows: list[Example], split: str) -> str:
    """", prompts N-M tokens (data.max_prompt_tokens K)" for the plan; ConfigError naming the first row longer
    than data.max_prompt_tokens (the rollout's context is sized from it: such a prompt would fail mid-run)."""
    limit = cfg.data.max_prompt_tokens
    if renderer is None:
        return f", prompt lengths not measured (no tokenizer at {cfg.model.path})"
    lengths = [len(renderer.prompt_ids(row.prompt)) for row in rows]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] > limit:
        over = sum(n > limit for n in lengths)
        raise ConfigError("data.max_prompt_tokens", f"is {limit}, but {over} {split} prompt(s) render longer, the "
                                                    f"longest {lengths[longest]} tokens (row {longest + 1}): raise it "
                                                    f"to {lengths[longest]} or drop those rows")
    return f", prompts {min(lengths)}-{lengths[longest]} tokens (data.max_prompt_tokens {limit})"


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
