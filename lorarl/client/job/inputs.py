"""A job's own inputs — its data, reward and workflow — found from the job file (its folder first) and
checked before any service starts (`lorarl run --dry-run` reads every row of each split and measures its
prompt against data.max_prompt_tokens, imports the reward and builds the workflow: a bad row or a bad reward
fails there, not a minute into the run).

Data that is not there yet (a file still to be made, a Hub dataset not yet in the cache) is a warning in the dry
run's plan, naming the key and what makes it, so a job file checks out on a fresh clone; `lorarl run` downloads a
missing Hub dataset and refuses a missing file, before it fetches the model or starts a service."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from lorarl.client.job.config import JobFileConfig, job_path
from lorarl.client.job.datasets import GSM8K_HUB, Example, MissingDataError, load_examples
from lorarl.client.job.rewards import RewardFn, load_reward
from lorarl.client.workflow import Workflow, load_workflow
from lorarl.common.config import ConfigError
from lorarl.contract.chat import ChatRenderer
from lorarl.contract.lora import LoraSpec
from lorarl.contract.peft import fit_problems, read_peft_config
from lorarl.v1 import rollout_pb2


@dataclass(frozen=True)
class Teacher:
    """One distillation teacher as the loop serves it: its adapter directory and LoRA spec (or, ``lora`` None, its
    full model's directory, on an engine of its own), and what routes to it."""

    name: str
    path: str
    lora: LoraSpec | None
    domain: str
    weight: float
    #: another job's published version (JOB, N) still to be read from the stack's weight sync
    #: (lorarl.client.rl.teacher_versions), then an adapter teacher like the others; None otherwise
    version_of: tuple[str, int] | None = None

    @property
    def own_engine(self) -> bool:
        """A full model, scored by an engine of its own (rollout.teacher_engines), not an adapter slot."""
        return self.lora is None and self.version_of is None

    def job_id(self, student: str) -> str:
        """The trainer job (and weight-sync job) that holds and publishes this teacher's adapter."""
        return f"{student}.teacher.{self.name}"

    def policy(self, student: str) -> rollout_pb2.PolicySelector:
        """How the student's rollout finds this teacher: its adapter job's latest version, or its engine."""
        if self.own_engine:
            return rollout_pb2.PolicySelector(engine=self.name)
        return rollout_pb2.PolicySelector(job_id=self.job_id(student))


def job_teachers(cfg: JobFileConfig) -> list[Teacher]:
    """distill.teachers read: each a PEFT LoRA directory the trainer can warm-start a job from and the rollout
    can serve (its rank within rollout.max_lora_rank); one that is not there yet is a MissingDataError naming
    what makes it, any other problem a ConfigError naming the teacher's key."""
    teachers = []
    for i, t in enumerate(cfg.distill.teachers):
        if t.model:
            teachers.append(model_teacher(cfg, i))
            continue
        if t.job:
            teachers.append(version_teacher(cfg, i))
            continue
        key = f"distill.teachers[{i}].adapter"
        path = str(Path(job_path(cfg, t.adapter)).resolve())
        if not Path(path).exists():
            raise MissingDataError(key, f"no adapter at {t.adapter!r} (teacher {t.name!r})",
                                   f"make it with: {t.make}" if t.make else "train the expert first and point this "
                                   "at its exported adapter")
        if cfg.trainer.engine != "torch":
            raise ConfigError(key, "teachers are loaded by the torch engine (trainer.engine=torch): Megatron cannot "
                                   "load a PEFT adapter yet")
        try:
            config = read_peft_config(path)
            lora = LoraSpec.from_peft_config(config)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(key, f"{path}: {e}") from None
        misfit = fit_problems(path, cfg.model.path)
        if misfit:
            raise ConfigError(key, f"teacher {t.name!r} ({path}, trained on {config.get('base_model_name_or_path')!r}) "
                                   f"does not fit this job's base {cfg.model.path!r}: " + "; ".join(misfit))
        if cfg.rollout.max_lora_rank and lora.rank > cfg.rollout.max_lora_rank:
            raise ConfigError("rollout.max_lora_rank", f"{cfg.rollout.max_lora_rank} is below teacher {t.name!r}'s "
                                                       f"rank {lora.rank} (0: sized for every adapter)")
        teachers.append(Teacher(t.name, path, lora, t.domain, t.weight))
    return teachers


def model_teacher(cfg: JobFileConfig, i: int) -> Teacher:
    """distill.teachers[i], a full model: there (else a MissingDataError naming what makes it), a Hugging Face model
    directory, and reading token ids as the job's model does (else a ConfigError naming both models)."""
    from lorarl.contract.token_mapping import token_mapping_mismatch

    t, key = cfg.distill.teachers[i], f"distill.teachers[{i}].model"
    path = Path(job_path(cfg, t.model)).resolve()
    if not path.exists():
        raise MissingDataError(key, f"no model at {t.model!r} (teacher {t.name!r})",
                               f"make it with: {t.make}" if t.make else "point this at the teacher model's directory")
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ConfigError(key, f"teacher {t.name!r}: {path} is not a Hugging Face model directory (config.json and "
                               "*.safetensors weights)")
    student = job_path(cfg, cfg.model.path)
    if Path(student).is_dir():  # a Hub model not fetched yet: `lorarl run` fetches it, then checks here again
        try:
            mismatch = token_mapping_mismatch(student, path)
        except (OSError, ValueError) as e:
            raise ConfigError(key, f"teacher {t.name!r}: could not read the tokenizer of {path} or of the job's model "
                                   f"{cfg.model.path!r}: {e}") from None
        if mismatch:
            raise ConfigError(key, f"teacher {t.name!r} ({path}) and this job's model {cfg.model.path!r} do not read "
                                   f"token ids alike: {mismatch}. A teacher scores the student's sampled token ids as "
                                   "they are: it needs the student's tokenizer")
    return Teacher(t.name, str(path), None, t.domain, t.weight)


def version_teacher(cfg: JobFileConfig, i: int) -> Teacher:
    """distill.teachers[i], another job's version JOB@vN: read from the stack's weight sync when the job starts (its
    adapter and rank are known then), so here only what the job file says."""
    t = cfg.distill.teachers[i]
    if cfg.trainer.engine != "torch":
        raise ConfigError(f"distill.teachers[{i}].job", "teachers are loaded by the torch engine (trainer.engine="
                                                         "torch): Megatron cannot load a PEFT adapter yet")
    job, _, version = t.job.rpartition("@v")
    return Teacher(t.name, "", None, t.domain, t.weight, version_of=(job, int(version)))


def domain_teacher(cfg: JobFileConfig, example: Example) -> int | None:
    """Route 'domain': the index (in distill.teachers) of the teacher whose domain is ``example``'s
    distill.route_key value; None when no teacher's is."""
    domain = str(example.columns.get(cfg.distill.route_key))
    return next((i for i, t in enumerate(cfg.distill.teachers) if t.domain == domain), None)


def teacher_routes(cfg: JobFileConfig, rows: list[Example]) -> dict[str, int]:
    """How many of ``rows`` each teacher scores (route 'domain': by the row's distill.route_key; 'mixture': all);
    ConfigError when a row's domain has no teacher (its samples could not be distilled)."""
    d = cfg.distill
    if d.route == "mixture":
        return {t.name: len(rows) for t in d.teachers}
    counts = {t.name: 0 for t in d.teachers}
    for n, row in enumerate(rows, 1):
        owner = domain_teacher(cfg, row)
        if owner is None:
            raise ConfigError("distill.route_key", f"train row {n} has {d.route_key}={row.columns.get(d.route_key)!r}, "
                                                   f"which no teacher's domain names (teachers' domains: "
                                                   f"{sorted(t.domain for t in d.teachers)})")
        counts[d.teachers[owner].name] += 1
    return counts


def job_examples(cfg: JobFileConfig, split: str, limit: int | None = None) -> list[Example]:
    """The train or test split's examples (``limit``: only the first rows); data that is not there is a
    MissingDataError that says what makes it."""
    d = cfg.data
    path = job_path(cfg, d.train_path if split == "train" else d.test_path)
    try:
        return load_examples(d.source, split, path, d.columns, d.train_split if split == "train" else d.test_split,
                             limit=limit, tasks=d.tasks, dataset=d.dataset, config=d.config)
    except MissingDataError as e:
        raise MissingDataError(e.key, e.what, how_to_get(cfg, split)) from None


def how_to_get(cfg: JobFileConfig, split: str) -> str:
    """What makes a split's missing data, and what `lorarl run` does meanwhile."""
    from lorarl.client.job.hub_datasets import offline

    d = cfg.data
    if d.dataset:
        if offline():
            return ("HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set, so `lorarl run` cannot download it: fetch it where "
                    "the network allows, with the same HF_HOME (`lorarl run` there downloads it)")
        return "`lorarl run` downloads it before anything starts"
    written = d.train_path if split == "train" else d.test_path
    if d.source == "gsm8k":
        folder = Path(written).parent.as_posix()
        return (f"`lorarl data gsm8k {folder}` writes {folder}/train.jsonl and test.jsonl (GSM8K, from the Hub's "
                f"{GSM8K_HUB[0]}); or read that from the Hub: data.dataset={GSM8K_HUB[0]} "
                f"data.config={GSM8K_HUB[1]}, in place of data.train_path / test_path. `lorarl run` refuses to start "
                "until the data is there")
    return (f"relative paths are looked up in the job file's folder ({getattr(cfg, 'job_dir', '') or '.'}), then "
            "the working directory; a Hugging Face Hub dataset goes in data.dataset (ORG/NAME), which `lorarl run` "
            "downloads. `lorarl run` refuses to start until the data is there")


def data_label(cfg: JobFileConfig, split: str) -> str:
    """Where a split's rows come from, as the plan says it."""
    d = cfg.data
    if d.dataset:
        from lorarl.client.job.hub_datasets import describe

        return f"{describe(d.dataset, d.config)} split {d.train_split if split == 'train' else d.test_split!r}"
    return job_path(cfg, d.train_path if split == "train" else d.test_path) or "(shipped tasks)"


def fetch_data(cfg: JobFileConfig, splits: tuple[str, ...] = ("train", "test")) -> None:
    """The job's data made present before anything starts: a Hub dataset (data.dataset) downloaded into the datasets
    cache where it is missing, and the first row of each of ``splits`` read, so a missing file is refused
    (ConfigError naming its key) before the model is fetched or a service started."""
    from lorarl.client.job.hub_datasets import download_dataset

    if cfg.data.dataset:
        download_dataset(cfg.data.dataset, cfg.data.config, "data.dataset")
    for split in splits:
        job_examples(cfg, split, limit=1)


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
    root = Path(cfg.model.path)
    if not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    d = cfg.data
    return ChatRenderer(cfg.model.path, chat_template=d.chat_template, system_prompt=d.system_prompt,
                        enable_thinking=d.enable_thinking)


def check_inputs(cfg: JobFileConfig, missing_ok: bool = False) -> list[str]:
    """Reads every row of both splits (their count said), measures each prompt as the loop renders it against
    data.max_prompt_tokens, imports the reward, builds the workflow; raises ConfigError naming the key at the
    first problem, else returns one line per input for the plan. ``missing_ok`` (the dry run): data that is not
    there yet is a WARNING line naming its key and what makes it, not an error."""
    lines, fixes = [], []
    renderer = prompt_renderer(cfg)
    train_rows: list[Example] = []
    for split in ("train", "test"):
        try:
            rows = job_examples(cfg, split)
        except MissingDataError as e:
            if not missing_ok:
                raise
            for line, said in ((f"WARNING {e.key}: {e.what}", lines), (f"  hint: {e.fix}", fixes)):
                if line not in said:  # data.dataset, or both files of one folder: said once
                    said.append(line)
            continue
        if not rows:
            raise ConfigError(f"data.{split}_path", f"the {split} split has no rows")
        if split == "train":
            train_rows = rows
        columns = sorted(rows[0].columns)
        kind = "chat" if isinstance(rows[0].prompt, list) else "text"
        lines.append(f"data {split}: {cfg.data.source} {data_label(cfg, split)}, {len(rows)} rows, {kind} prompts, "
                     f"columns {columns}{prompt_lengths(cfg, renderer, rows, split)}")
    lines += fixes
    job_reward(cfg)
    lines.append(f"reward: {cfg.data.reward}")
    if cfg.trainer.init_adapter:
        lines.append(f"warm start: {check_warm_start(cfg)}")
    lines += distill_lines(cfg, train_rows, missing_ok)
    workflow = job_workflow(cfg)
    lines.append(f"workflow: {cfg.workflow.name} ({type(workflow).__module__}.{type(workflow).__qualname__})")
    return lines


def distill_lines(cfg: JobFileConfig, train_rows: list[Example], missing_ok: bool) -> list[str]:
    """The plan's lines for distill.teachers: each teacher's adapter and rank (or full model), and the share of the
    train rows it scores; a teacher not there yet is a WARNING (with what makes it) when ``missing_ok``."""
    if not cfg.distill.teachers:
        return []
    lines = []
    try:
        teachers = {t.name: t for t in job_teachers(cfg)}
    except MissingDataError as e:
        if not missing_ok:
            raise
        lines += [f"WARNING {e.key}: {e.what}", f"  hint: {e.fix}"]
        teachers = {}
    counts = teacher_routes(cfg, train_rows) if train_rows else {}
    for t in cfg.distill.teachers:
        have = teachers.get(t.name)
        if have is None:
            adapter = f"{t.adapter or t.model} (not there yet)"
        elif have.version_of is not None:
            adapter = (f"{have.version_of[0]} v{have.version_of[1]} (another job's version, read from the stack's "
                       "weight sync when the run starts)")
        elif have.lora is None:
            adapter = f"{have.path} (a full model on an engine of its own; the job's tokenizer)"
        else:
            adapter = f"{have.path} (rank {have.lora.rank})"
        share = f", {counts[t.name]} of {len(train_rows)} train rows" if t.name in counts else ""
        lines.append(f"teacher {t.name}: {adapter}, route {cfg.distill.route}"
                     f"{f' {cfg.distill.route_key}={t.domain}' if cfg.distill.route == 'domain' else ''}{share}")
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

    try:
        fetch_data(cfg)
    except ConfigError as e:
        print(f"lorarl: bad config: {e}", file=sys.stderr)
        return False
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
