"""The RL job a user runs: one YAML file, dotted overrides on the command line, validated up front.

    lorarl run examples/demo.yaml loop.steps=20 trainer.lora.rank=16

Every key is checked before any service starts: a wrong key, type or value is a ConfigError naming
the dotted key (lorarl.common.config does the work).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lorarl.client.job.datasets import HUB_SOURCES, SOURCES
from lorarl.client.job.rewards import REWARD_ERRORS
from lorarl.common.config import Check, ConfigError, all_of, in_range, matches, multiple_of, setting
from lorarl.contract import staleness
from lorarl.contract.errors import SpecError
from lorarl.contract.lora import (
    ALL_LINEAR,
    DEFAULT_RANK,
    MAX_RANK,
    VLLM_LORA_RANKS,
    ExpertMode,
    LoraSpec,
    default_alpha,
    serving_rank,
)
from lorarl.contract.training import (
    DEFAULT_MAX_SEQUENCE_TOKENS,
    MAX_PARALLEL,
    LimitsSpec,
    LossSpec,
    MegatronSpec,
    MemorySpec,
    OptimizerSpec,
    TrainingSpec,
    loss_for_loop,
)
from lorarl.platform import device_kind

SyncModeName = Literal["adapter", "merged", "auto"]
LoopMode = Literal["sync", "async"]


@dataclass
class ModelConfig:
    path: str = setting("lorarl/assets/models/qwen3-tiny", doc="Local Hugging Face model directory (base policy).")
    dtype: Literal["float32", "bfloat16"] = setting("float32", doc="Trainer dtype.")
    shape: str = setting("", doc="Known shape (e.g. 'qwen3-8b') for --dry-run plans when the weights are absent.")


@dataclass
class DataConfig:
    source: str = setting("tasks", doc="How rows become examples: 'tasks' (the shipped synthetic tasks), 'jsonl', "
                                       "'gsm8k' (question/answer, the gold number taken from the solution), or "
                                       "'datasets' (any local file or folder Hugging Face datasets reads: jsonl, json, "
                                       "parquet, csv, arrow, save_to_disk; or a hub dataset already in the local "
                                       "cache). Where a Hub dataset's rows come from is data.dataset.")
    train_path: str = setting("", doc="Train file, folder or cached hub name (relative paths: from the job file's "
                                      "folder, then the working directory).")
    test_path: str = setting("", doc="Held-out file, folder or cached hub name.")
    dataset: str = setting("", doc="A Hugging Face Hub dataset (ORG/NAME, e.g. openai/gsm8k) whose splits "
                                   "data.train_split and data.test_split are the data, instead of data.train_path / "
                                   "test_path; with data.source datasets or gsm8k. Read from the datasets cache "
                                   "(HF_HOME / HF_DATASETS_CACHE): a dry run never downloads; `lorarl run` downloads "
                                   "it first where missing, unless HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set.")
    config: str = setting("", doc="The configuration (subset) of data.dataset, e.g. 'main' of openai/gsm8k (empty: "
                                  "its only one).")
    train_split: str = setting("train", doc="Split to train on, of data.dataset or of a folder or hub name "
                                            "(data.source=datasets).")
    test_split: str = setting("test", doc="Split to evaluate on, of data.dataset or of a folder or hub name "
                                          "(data.source=datasets).")
    tasks: list[str] = setting(default_factory=list, doc="data.source=tasks: which of the shipped tasks ('add', "
                                                         "'sort') to train and evaluate on (empty: all).")
    columns: dict[str, str] = setting(default_factory=dict, doc="Which columns hold the prompt and the answer, "
                                      "e.g. {prompt: question, answer: solution}; default prompt/answer "
                                      "(question/answer for gsm8k). Every column reaches the reward and the workflow.")
    reward: str = setting("exact", doc="Reward by name ('exact', 'exact_format', 'format', 'gsm8k') or "
                                       "'module:function' (the job file's folder is on the import path): "
                                       "f(completion, answer), f(prompt, completion, **columns) or batched "
                                       "f(prompts, completions, **columns) -> list; sync or async.")
    reward_errors: str = setting("zero", doc="A reward that raises or returns NaN/inf: 'zero' scores the sample 0 "
                                             "(counted in rollout/reward_errors), 'fail' ends the run.")
    reward_workers: int = setting(4, check=in_range(1, 256), doc="Threads a synchronous reward runs on, off the "
                                                                 "loop's event loop (an async reward is awaited).")
    chat_template: bool = setting(True, doc="Render a string prompt as a user turn with the model's chat template "
                                            "(a prompt that is a list of messages is always a chat).")
    system_prompt: str = setting("", doc="A system turn put before every chat prompt that has none.")
    enable_thinking: bool | None = setting(None, doc="The chat template's enable_thinking switch (Qwen3); "
                                                     "null: the template's default.")
    eval_size: int = setting(0, check=in_range(0), doc="Held-out problems evaluated (0: all).")
    eval_by: str = setting("", doc="A column of the held-out rows whose values split the held-out accuracy "
                                   "(eval/<value>/accuracy beside eval/accuracy), e.g. each task of a mixed dataset; "
                                   "empty: distill.route_key when teachers route by it, else none.")
    max_prompt_tokens: int = setting(256, check=in_range(1), doc="Longest prompt in tokens: the --dry-run plan's "
                                                                 "sequence length is this plus rollout.max_tokens.")
    seed: int = setting(0, check=in_range(0), doc="Shuffle seed of the train stream.")

    def validate(self) -> None:
        if self.reward_errors not in REWARD_ERRORS:
            raise ConfigError("reward_errors", f"expected one of {list(REWARD_ERRORS)}, got {self.reward_errors!r}")
        if self.source not in SOURCES:
            raise ConfigError("source", f"expected one of {list(SOURCES)}, got {self.source!r} (a Hugging Face Hub "
                                        "dataset is data.dataset: ORG/NAME, with data.source datasets or gsm8k)")
        if self.dataset:
            self._check_dataset()
        elif self.config:
            raise ConfigError("config", "names a configuration of data.dataset (a Hugging Face Hub dataset): set "
                                        "data.dataset: ORG/NAME too, or drop data.config")
        elif self.source != "tasks" and not (self.train_path and self.test_path):
            hub = " (or data.dataset: a Hugging Face Hub dataset's two splits)" if self.source in HUB_SOURCES else ""
            raise ConfigError("train_path", f"data.source={self.source} needs data.train_path and data.test_path{hub}")
        if self.tasks:
            from lorarl.assets.tasks import TASK_KINDS

            if self.source != "tasks":
                raise ConfigError("tasks", f"chooses among the shipped tasks (data.source=tasks), not {self.source}")
            if unknown_tasks := sorted(set(self.tasks) - set(TASK_KINDS)):
                raise ConfigError("tasks", f"unknown task {unknown_tasks[0]!r}; the shipped ones: {sorted(TASK_KINDS)}")
        unknown = set(self.columns) - {"prompt", "answer"}
        if unknown:
            raise ConfigError("columns", f"maps 'prompt' and 'answer' only, got {sorted(unknown)}")

    def _check_dataset(self) -> None:
        """data.dataset: a Hub id, read with a source that takes any rows, and the only place the data is named."""
        from lorarl.client.job.hub import REPO_ID

        if self.source not in HUB_SOURCES:
            raise ConfigError("dataset", f"is read with data.source datasets (its columns as data.columns maps them) "
                                         f"or gsm8k (question/answer, the gold number taken); data.source is "
                                         f"{self.source!r}")
        if not REPO_ID.fullmatch(self.dataset):
            raise ConfigError("dataset", f"expected a Hugging Face Hub dataset id ORG/NAME (e.g. openai/gsm8k), got "
                                         f"{self.dataset!r}; local files and folders go in data.train_path / "
                                         "data.test_path")
        if self.train_path or self.test_path:
            raise ConfigError("dataset", "names both splits (data.train_split, data.test_split): drop "
                                         "data.train_path / data.test_path, or data.dataset")


@dataclass
class WorkflowSection:
    name: str = setting("single_turn", doc="The episode: 'single_turn' (a prompt, a group of sampled completions, "
                                           "a reward each) or your own 'package.module:Class' (a "
                                           "lorarl.client.workflow.Workflow; the job file's folder is on the "
                                           "import path).")
    settings: dict[str, Any] = setting(default_factory=dict, doc="Keyword arguments of the workflow's class.")


@dataclass
class LoraSection:
    """The job file's `trainer.lora`: the fields of lorarl.contract.lora.LoraSpec, with its defaults."""

    rank: int = setting(DEFAULT_RANK, check=in_range(1, MAX_RANK), doc="LoRA rank r of every adapted module.")
    alpha: float | None = setting(None, check=in_range(0.0), doc="Default: twice the rank.")
    dropout: float = setting(0.0, check=in_range(0.0, 0.99), doc="Dropout on the adapter's input (0: none).")
    target_modules: list[str] = setting(default_factory=lambda: [ALL_LINEAR], doc="Projections to adapt: 'all-linear' "
        "or names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); a name that matches no module of "
        "the model is refused.")
    expert_mode: ExpertMode = setting("per_expert", doc="MoE models: an adapter per expert, one 'shared' by all "
        "experts of a layer, or 'none' (experts not adapted).")
    use_rslora: bool = setting(False, doc="rsLoRA: the adapter's scale divides alpha by the square "
        "root of the rank, not by the rank.")

    def validate(self) -> None:
        try:
            self.spec().check_trainable()  # known projection names, vLLM-servable combinations
        except SpecError as e:
            raise ConfigError(e.field, e.problem) from None

    def spec(self) -> LoraSpec:
        return LoraSpec(rank=self.rank, alpha=self.alpha or default_alpha(self.rank),
                        target_modules=tuple(self.target_modules), dropout=self.dropout,
                        expert_mode=self.expert_mode, use_rslora=self.use_rslora)


@dataclass
class ParallelSection:
    tensor: int = setting(1, check=in_range(1, MAX_PARALLEL), doc="Tensor-parallel size (megatron engine).")
    pipeline: int = setting(1, check=in_range(1, MAX_PARALLEL), doc="Pipeline stages: megatron's pipeline-parallel "
                            "ranks; the torch engine splits its decoder layers across this many devices of its one "
                            "process.")
    expert: int = setting(1, check=in_range(1, MAX_PARALLEL), doc="Expert-parallel size (megatron engine, MoE).")
    data: int = setting(1, check=in_range(1, MAX_PARALLEL), doc="Data-parallel size.")

    @property
    def world_size(self) -> int:
        # Megatron's expert-parallel group is carved out of the data x tensor ranks, not added to them.
        return self.tensor * self.pipeline * self.data

    def ranks(self, engine: str) -> int:
        """Trainer processes: one per device for megatron; the torch engine's layer split is one process."""
        return self.world_size if engine == "megatron" else self.data


@dataclass
class TrainerSection:
    device: str = setting("cpu", doc="cpu, cuda or npu (the first of the trainer's devices).")
    engine: Literal["torch", "megatron"] = setting("torch", doc="'torch' (transformers) or 'megatron' (TP/PP/EP).")
    parallel: ParallelSection = field(default_factory=ParallelSection)
    seed: int = setting(0, check=in_range(0), doc="Seed of the adapter's initialisation and the trainer's RNG.")
    lora: LoraSection = field(default_factory=LoraSection)
    # The training spec's own classes (lorarl.contract.training): their defaults, bounds and docs.
    loss: LossSpec = field(default_factory=LossSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    memory: MemorySpec = field(default_factory=MemorySpec)
    init_adapter: str = setting("", doc="A PEFT LoRA adapter directory to start from (warm start; torch engine); "
                                        "its r, lora_alpha, target_modules and use_rslora must match trainer.lora.")
    routing_replay: Literal["auto", "on", "off"] = setting(
        "auto", doc="MoE models: the rollout records the experts its routers choose and the trainer's routers use "
                    "them (R3). 'auto': on for MoE models with vLLM rollouts (either trainer engine); 'on': refuse a "
                    "job that cannot; 'off': route live.")
    fingerprint_check: Literal["refuse", "flag", "off"] = setting(
        "refuse", doc="A trajectory whose tokens a rollout produced with other weights than the trainer published for "
                      "their version (their fingerprints differ): 'refuse' it, 'flag' it (accepted, counted in "
                      "lorarl_trainer_job_fingerprint_mismatches), or 'off'.")
    share: float = setting(1.0, check=in_range(0.001, 1000.0), doc="This job's weight when jobs on one resident base "
                           "take turns on it: share 2 gets twice the compute time of share 1 while both wait.")


@dataclass
class RolloutSection:
    engine: Literal["vllm", "hf"] = setting("vllm", doc="'vllm', or 'hf' (transformers generate: slow, no prompt "
        "logprobs; for platforms vLLM does not run on).")
    dtype: Literal["float32", "bfloat16"] | None = setting(
        None, doc="The rollout engines' dtype (null: model.dtype, the trainer's). bfloat16 rollouts with a float32 "
                  "trainer is a common mismatch: the rollout-vs-trainer monitor and rollout correction see it.")
    group_size: int = setting(8, check=in_range(1, 64), doc="Completions per prompt (GRPO group).")
    temperature: float = setting(1.0, check=in_range(0.0, 10.0), doc="Sampling temperature of training rollouts "
        "(held-out evaluation is greedy).")
    top_p: float = setting(1.0, check=in_range(0.0, 1.0), doc="Nucleus sampling of training rollouts (1: off).")
    max_tokens: int = setting(8, check=in_range(1, 65536), doc="Longest completion sampled for training, in tokens (a "
        "longer one is cut: rollout/truncated_fraction).")
    eval_max_tokens: int = setting(8, check=in_range(1, 65536), doc="Longest completion of a held-out evaluation, in "
        "tokens.")
    kv_cache_gib: float = setting(1.0, check=in_range(0.0625), doc="vLLM's KV cache per replica, in GiB.")
    gpu_memory_utilization: float | None = setting(
        None, check=in_range(0.05, 1.0), doc="Share of a GPU a vLLM engine may use (null: vLLM's 0.9).")
    enforce_eager: bool | None = setting(
        None, doc="Skip CUDA graphs (null: on CPU only; GPUs capture graphs for fast decoding).")
    max_model_len: int = setting(
        0, check=in_range(0), doc="Context the engines serve (0: the smallest power of two >= 2048 holding "
        "data.max_prompt_tokens + the longer of max_tokens and eval_max_tokens, at most the model's).")
    max_lora_rank: int = setting(0, doc=f"Largest adapter rank the engines serve, one of {VLLM_LORA_RANKS} (0: the "
                                        "smallest of them that holds trainer.lora.rank).")
    replicas: int = setting(1, check=in_range(1, 1024), doc="Rollout services (vLLM engines) in the job.")
    max_loras: int = setting(0, check=in_range(0, 1024), doc="Adapters each replica holds at once, all jobs "
                             "together (0: what this run's jobs need; more leaves room for jobs that `lorarl run "
                             "--attach` adds later).")
    max_num_seqs: int = setting(0, check=in_range(0, 4096),
                                doc="Sequences a vLLM engine decodes at once (0: a whole step's batch, >= 64).")
    openai: bool = setting(False, doc="Serve the OpenAI-compatible endpoint on every replica (rollout.openai_port), "
                                       "for workflows whose agent code uses the openai client (ctx.openai_client()).")
    tensor_parallel_size: int = setting(1, check=in_range(1, 64), doc="Devices per rollout replica (vLLM TP; on "
                                        "CPU one worker process per TP rank, each bound to CPUs of its own).")
    enable_lora: bool | None = setting(
        None, doc="Start vLLM with LoRA (null: no in a merged job, whose rollouts serve merged weights only; "
                  "elsewhere yes unless the model cannot run LoRA on this platform). true in a merged job: merged "
                  "weights load into the LoRA-wrapped layers, and the replica can serve other jobs' adapters.")
    receive_in_worker: Literal["auto", "on", "off"] = setting(
        "auto", doc="vLLM's workers join the weight transfer themselves, one rank each, and receive into their "
                    "own device memory ('auto': on GPUs and NPUs, off on CPU); see the rollout service's setting.")
    block_size: int = setting(
        0, check=all_of(in_range(0), multiple_of(16)),
        doc="vLLM KV-cache block in tokens, a multiple of 16 (0: vLLM's default). Prefix caching shares whole "
            "blocks only: blocks no longer than the prompts let a group share its prefill.")

@dataclass
class MismatchAlarmSection:
    """`loop.mismatch_alarm`: when the rollout-vs-trainer KL is a problem (lorarl.client.rl.mismatch)."""

    window: int = setting(5, check=in_range(0, 1000), doc="Steps the KL must rise in a row, at a flat learning "
                                                          "rate, to fire (0: off).")
    growth: float = setting(4.0, check=in_range(1.0), doc="...and the factor it must have grown by over them.")
    floor: float = setting(1e-4, check=in_range(0.0), doc="KL values below this never count as growing (a KL of "
                                                          "1e-9 doubling is float noise).")
    max_kl: float | None = setting(None, check=in_range(0.0), doc="Fire whenever the KL exceeds this (null: no "
                                                                  "ceiling).")
    action: Literal["warn", "fail"] = setting("warn", doc="'warn': log it and set policy/mismatch_alarm; 'fail': "
                                                          "also end the run.")


@dataclass
class StallSection:
    """`loop.stall`: what a run that stops moving does (lorarl.client.rl.stall)."""

    after_s: float = setting(600.0, check=in_range(0.0), doc="Seconds without any call to a service ending before "
                                                           "the run names the calls it waits on (0: off).")
    action: Literal["warn", "fail"] = setting("warn", doc="'warn': log them, once per stall; 'fail': end the run "
                                                          "with that message.")


@dataclass
class PolicyGuardSection:
    """`loop.policy_guard`: each served version's probe logprobs against the trainer's (lorarl.client.rl.guard)."""

    every: int = setting(1, check=in_range(0, 100_000), doc="Check every K-th version (0: off).")
    tolerance: float = setting(0.03, check=in_range(0.0), doc="Largest mean |rollout - trainer| logprob over the "
                                                              "probe's tokens (bfloat16 rollouts: ~0.002-0.01).")
    action: Literal["warn", "fail"] = setting("fail", doc="'fail': a version past the tolerance ends the run, naming "
                                                          "replica and version; 'warn': log it, policy/guard_alarm.")


@dataclass
class LoopSection:
    mode: LoopMode = setting("async", doc="'sync': generate, then train, then sync; 'async': generate while "
                                          "training, at most max_staleness versions behind.")
    steps: int = setting(40, check=in_range(1), doc="Training steps (one optimizer step and one policy version each).")
    prompts_per_step: int = setting(16, check=in_range(1), doc="Prompts per step; each is sampled rollout.group_size "
        "times.")
    max_staleness: int = setting(1, check=in_range(0, 64), doc="Async loop: how many policy versions a sample may lag "
        "the trainer; older tokens are masked.")
    eval_every: int = setting(10, check=in_range(0), doc="Evaluate every K steps (0: only before and after).")
    checkpoint_every: int = setting(0, check=in_range(0), doc="Checkpoint every K steps (0: only at the end).")
    keep_checkpoints: int = setting(0, check=in_range(0), doc="Step checkpoints kept on the trainer, the newest "
                                    "(0: all); older ones are removed as each new one is saved.")
    time_limit_s: float = setting(0.0, check=in_range(0.0), doc="Stop after this much wall time (0: no limit).")
    call_timeout_s: float = setting(
        1800.0, check=in_range(0.0), doc="Deadline of every call the loop makes to a service (0: none): a service "
        "that hangs ends its call with DEADLINE_EXCEEDED naming service and call, which the loop recovers from "
        "(recovery.max_recoveries) or fails with, instead of waiting forever.")
    success_reward: float = setting(1.0, doc="A sample whose reward is >= this counts as a success: rollout/accuracy "
                                    "and eval/accuracy are the share of successes (a 0-1 reward: 1 is a correct "
                                    "answer). Lower it for rewards on another scale or with partial credit.")
    mismatch_alarm: MismatchAlarmSection = field(default_factory=MismatchAlarmSection)
    policy_guard: PolicyGuardSection = field(default_factory=PolicyGuardSection)
    stall: StallSection = field(default_factory=StallSection)


@dataclass
class RecoverySection:
    """How a run rides through a service that dies or restarts (lorarl.client.rl.recovery)."""

    enabled: bool = setting(True, doc="Wait out a service's restart and carry on from the last resume point "
                                      "(False: the first failed call ends the run).")
    resume_every: int = setting(1, check=in_range(1), doc="Save a resume point (adapter + optimiser state) every "
                                "K steps: a fault redoes at most K steps.")
    max_recoveries: int = setting(10, check=in_range(0, 1000), doc="Faults in a row the run survives before it gives "
                                  "up (see healthy_steps).")
    healthy_steps: int = setting(20, check=in_range(0), doc="Steps without a fault after a recovery that make the "
                                 "run healthy again: the fault count and its growing pause start over (0: "
                                 "max_recoveries counts every fault of the run).")
    wait_s: float = setting(300.0, check=in_range(1.0), doc="How long to wait for the services to answer again "
                            "after a fault.")
    restarts: int = setting(5, check=in_range(0, 1000), doc="`lorarl run`: times in a row each service is "
                            "restarted after it exits (with backoff) before the run fails; a restarted service that "
                            "stays up a minute starts its count again.")


@dataclass
class SyncSection:
    mode: SyncModeName = setting("auto", doc="'adapter', 'merged' or 'auto' (adapter if every replica can).")
    collective: bool = setting(True, doc="Bytes over a gloo/nccl/hccl group (False: inline gRPC).")


#: `lorarl slurm`: a service's Prometheus port is its gRPC port plus this (output.prometheus).
METRICS_PORT_OFFSET = 1000
#: What W&B refuses in a project or entity name.
WANDB_FORBIDDEN = "/\\#?%:"


def wandb_name(*, empty: bool = True, forbidden: str = WANDB_FORBIDDEN, longest: int = 128) -> Check:
    """A check of a name W&B takes: refused when the job file loads, not by the first wandb.init of a run that
    has already started its services."""

    def check(value: Any) -> str | None:
        names = value if isinstance(value, list) else [value]  # wandb_tags: each of them
        for name in names:
            if not name:
                if not empty:
                    return "a name, got ''"
                continue
            if len(name) > longest:
                return f"at most {longest} characters, got {len(name)}"
            if bad := sorted({c for c in name if c in forbidden}):
                return f"no {' '.join(repr(c) for c in bad)} (W&B refuses them), got {name!r}"
            if name != name.strip():
                return f"no leading or trailing spaces, got {name!r}"
        return None

    return check


@dataclass
class OutputSection:
    dir: str = setting("runs/demo", doc="Metrics, plots, checkpoints and service logs go here.")
    tensorboard: bool = setting(True, doc="Write TensorBoard event files (if tensorboard is installed).")
    wandb: bool = setting(False, doc="Log to Weights & Biases (if installed).")
    progress: bool = setting(True, doc="Show a progress line.")
    service_log_mib: float = setting(64.0, check=in_range(0.0), doc="`lorarl run`: a service's log "
                                     "(<dir>/services/NAME.log) is rotated when it reaches this size (0: never).")
    service_log_backups: int = setting(2, check=in_range(0, 100), doc="Rotated copies of each service log kept "
                                       "(NAME.log.1 newest); older output is dropped.")
    prometheus: bool = setting(False, doc="Each service serves Prometheus metrics over HTTP (GET /metrics: its RPC "
                               "counts and latencies, the trainer's per-job series): `lorarl run` and "
                               "launcher.kind=ray on a free port per service, kept across its restarts; `lorarl slurm` "
                               f"on the service's gRPC port + {METRICS_PORT_OFFSET}. Printed at start, and written "
                               "under <dir>/services: each service's ready file (NAME.ready.json: metrics_port) and, "
                               "for `lorarl run`, stack.json.")
    prometheus_host: str = setting("127.0.0.1", doc="Address the metrics endpoints bind. They have no "
                                   "authentication: loopback unless a scraper on another host needs them (then e.g. "
                                   "0.0.0.0, on a network you trust).")
    wandb_project: str = setting("lorarl", check=wandb_name(empty=False),
                                 doc="Weights & Biases project of the run (output.wandb).")
    wandb_run: str = setting("", check=wandb_name(forbidden=""), doc="Weights & Biases run name ('': the job_id).")
    wandb_entity: str = setting("", check=wandb_name(), doc="Weights & Biases entity, a team or user ('': your "
                                "default entity).")
    wandb_tags: list[str] = setting(default_factory=list, check=wandb_name(empty=False, forbidden="", longest=64),
                                    doc="Weights & Biases tags of the run (each 1-64 characters).")

    def validate(self) -> None:
        if not self.prometheus_host.strip():
            raise ConfigError("prometheus_host", "must not be empty (127.0.0.1: this host only)")


@dataclass
class PlacementSection:
    """Where the job runs: devices and memory for the --dry-run plan, CPUs for `lorarl run`."""

    nodes: int = setting(1, check=in_range(1, 4096), doc="Hosts the job runs on (the plan and the cluster launchers; "
        "`lorarl run` on one host uses 1).")
    devices_per_node: int = setting(0, check=in_range(0, 64), doc="Accelerators per node (0: CPU only).")
    device_memory_gib: float = setting(0.0, check=in_range(0.0), doc="Memory per accelerator (0: unknown).")
    device_tflops: float = setting(0.0, check=in_range(0.0), doc="Dense peak TFLOP/s per accelerator in the job's "
                                   "dtype, for the plan's step-time estimate (0: unknown; H100/H200 bf16: 989).")
    device_bandwidth_gbs: float = setting(0.0, check=in_range(0.0), doc="Memory bandwidth per accelerator in GB/s "
                                          "(0: unknown; H100 SXM: 3350, H200: 4800).")
    colocate: bool = setting(False, doc="Trainer and rollout compute on ONE resident copy of the frozen base "
                             "(shared memory the launcher holds, mapped read-only by both; issue 'one base'), and "
                             "each adapter version reaches the rollout as a memory file, not over a collective. "
                             "CPU host, one vLLM replica at tensor parallel size 1, one trainer process, adapter "
                             "sync, `lorarl run` on this host.")
    pin_cpus: Literal["auto", "off"] = setting(
        "auto", doc="`lorarl run`, CPU job on one host: 'auto' keeps vLLM's engine core and the trainer on CPUs "
        "of their own in an async loop (half each; 6-7% shorter steps on 2 cores), and gives each all CPUs, "
        "one OpenMP thread per CPU, in a sync loop, where they take turns (bench/RESULTS.md); 'off': the OS "
        "places them, one thread each.")


@dataclass
class TeacherSection:
    """One teacher of on-policy distillation, that scores the sampled tokens of every prompt routed to it
    (trainer.loss.type opd, or distill_weight): a LoRA adapter on the job's own base, served by the job's rollout
    beside the student's versions (one more adapter slot, no weights beyond the adapter), or a full model with the
    job's tokenizer on an engine of its own."""

    name: str = setting("", check=matches(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}", "1-32 letters, digits, '_', '.', '-'"),
                        doc="The teacher's name in metrics (distill/<name>/...) and on the trainer (<job_id>.teacher."
                            "<name>).")
    adapter: str = setting("", doc="A PEFT LoRA directory trained on the job's base model (adapter_config.json + "
                                   "adapter_model.safetensors: a lorarl export, a PEFT save); relative paths from the "
                                   "job file's folder first.")
    model: str = setting("", doc="Instead of an adapter: a full model directory (Hugging Face config, safetensors "
                                 "weights and the job's own tokenizer) served by an engine of its own beside the "
                                 "student's (`lorarl run`'s local launcher, a CPU job; its own copy of the weights: "
                                 "for a teacher that is not an adapter of the job's base). Relative paths from the "
                                 "job file's folder first.")
    job: str = setting("", check=matches(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,63}@v[1-9][0-9]{0,17})?",
                                         "JOB@vN: a job id, '@v' and a version number from 1"),
                       doc="Instead of an adapter: another job's published version, JOB@vN, read from the weight "
                           "sync of the stack this job runs on (`lorarl run --attach RUN_DIR` of the run JOB trained "
                           "in, or `lorarl train --weightsync`): an adapter version on this job's base, which weight "
                           "sync still keeps (the job's newest versions, 3 by default, and its active one).")
    domain: str = setting("", doc="With distill.route 'domain': the value of each data row's distill.route_key that "
                                  "sends its prompt to this teacher.")
    weight: float = setting(1.0, check=in_range(0.0), doc="With distill.route 'mixture': this teacher's weight "
                                                          "(normalised over the teachers).")
    make: str = setting("", doc="The command that makes the adapter, said in the plan while it is not there yet "
                                "(e.g. the expert's own `lorarl run ...`).")


@dataclass
class DistillSection:
    """On-policy distillation: teachers (adapters on the same base) score the student's own samples in the
    student's rollout engine, and the loss pulls each sampled token toward its teacher (docs/rl.md)."""

    teachers: list[TeacherSection] = setting(default_factory=list, doc="The teachers (none: no distillation).")
    route: Literal["domain", "mixture"] = setting(
        "domain", doc="'domain': each prompt scored by the teacher whose domain is its row's distill.route_key; "
                      "'mixture': every prompt by all teachers, as log sum_i w_i p_i.")
    route_key: str = setting("domain", doc="The data column that names each row's domain (route 'domain').")


@dataclass
class LauncherSection:
    """What starts the services for `lorarl run`: this host ('local'), or a Ray cluster ('ray')."""

    kind: Literal["local", "ray"] = setting("local", doc="'local': every service a process on this host; 'ray': "
                                            "services placed on a Ray cluster's nodes by placement groups "
                                            "(pip install 'lorarl[ray]').")
    address: str = setting("auto", doc="The Ray cluster: 'auto' ($RAY_ADDRESS, else the cluster `ray start` "
                                       "began on this host) or the head's host:port.")
    connect_timeout_s: float = setting(30.0, check=in_range(1.0), doc="How long to try reaching the Ray cluster.")
    place_timeout_s: float = setting(120.0, check=in_range(1.0), doc="How long to wait for the cluster to grant "
                                     "the placement groups (a shortfall is refused before that when it shows in "
                                     "the cluster's totals).")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = setting(
        "SPREAD", doc="Ray placement strategy of the rollout replicas' bundles (one bundle per replica); "
        "weight sync and the trainer share one node (STRICT_PACK).")
    cpus_per_service: float = setting(1.0, check=in_range(0.0), doc="CPUs each service's bundle asks for.")
    trainer_resources: dict[str, float] = setting(default_factory=dict, doc="Custom Ray resources the trainer's "
                                                  "(and weight sync's) bundle asks for, to pin it to nodes that "
                                                  "advertise them (`ray start --resources`).")
    rollout_resources: dict[str, float] = setting(default_factory=dict, doc="Custom Ray resources each rollout "
                                                  "replica's bundle asks for.")
    workdir: str = setting("", doc="Folder on each node for the services' configs, ready files and logs "
                                   "(empty: <output.dir>/services/nodes); their logs are streamed to "
                                   "<output.dir>/services/ on the host running `lorarl run` either way.")


@dataclass
class JobFileConfig:
    """The whole job file."""

    job_id: str = setting("demo", doc="Job name (letters, digits, '_', '.', '-').")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    workflow: WorkflowSection = field(default_factory=WorkflowSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    loop: LoopSection = field(default_factory=LoopSection)
    recovery: RecoverySection = field(default_factory=RecoverySection)
    sync: SyncSection = field(default_factory=SyncSection)
    output: OutputSection = field(default_factory=OutputSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    launcher: LauncherSection = field(default_factory=LauncherSection)
    distill: DistillSection = field(default_factory=DistillSection)

    def validate(self) -> None:
        import re

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.job_id):
            raise ConfigError("job_id", f"1-64 letters, digits, '_', '.', '-'; got {self.job_id!r}")
        # (pure distillation reads no group: each token's advantage is its reverse KL to the teacher)
        if self.rollout.group_size == 1 and not self.trainer.loss.takes_token_advantages and \
                self.trainer.loss.reward_scale:
            raise ConfigError("rollout.group_size", f"is 1 with trainer.loss.type {self.trainer.loss.type!r}, whose "
                                                    "advantages are relative to the other samples of the same prompt: "
                                                    "every advantage would be 0 and nothing would train; use 2 or more")
        if self.rollout.enable_lora is False and self.sync.mode != "merged":
            raise ConfigError("rollout.enable_lora", f"is false, so the rollout cannot serve adapters; sync.mode is "
                                                     f"{self.sync.mode!r}: set sync.mode=merged or enable LoRA")
        if self.rollout.max_lora_rank and self.rollout.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError("rollout.max_lora_rank", f"expected 0 or one of {VLLM_LORA_RANKS}, "
                                                       f"got {self.rollout.max_lora_rank}")
        if self.rollout.max_lora_rank and self.rollout.max_lora_rank < self.trainer.lora.rank \
                and self.sync.mode != "merged":
            raise ConfigError("rollout.max_lora_rank",
                              f"{self.rollout.max_lora_rank} is below trainer.lora.rank={self.trainer.lora.rank} "
                              "(0: derived from it)")
        parallel = self.trainer.parallel
        if self.trainer.routing_replay == "on" and not records_routes(self):
            raise ConfigError("trainer.routing_replay", "'on' needs a MoE model (model.path's config names experts) "
                                                        "and rollout.engine vllm; use 'auto'")
        if self.trainer.engine == "torch" and (parallel.tensor, parallel.expert) != (1, 1):
            raise ConfigError("trainer.parallel", "tensor/expert parallelism needs trainer.engine=megatron")
        if self.trainer.engine == "torch" and parallel.pipeline > 1 and parallel.data > 1:
            raise ConfigError("trainer.parallel.data", "the torch engine's layer split (parallel.pipeline > 1) runs in "
                                                       "one trainer process: data parallelism with it needs megatron")
        if parallel.expert > 1 and (parallel.data * parallel.tensor) % parallel.expert:
            raise ConfigError("trainer.parallel.expert", f"{parallel.expert} must divide data x tensor ranks "
                                                         f"({parallel.data * parallel.tensor})")
        self._check_ascend()
        self._check_distill()
        if self.placement.colocate:
            self._check_colocate()
        if self.placement.devices_per_node and not self.placement.colocate:  # co-located: one device for both
            needed = parallel.world_size + self.rollout.replicas * self.rollout.tensor_parallel_size
            have = self.placement.nodes * self.placement.devices_per_node
            if needed > have:
                raise ConfigError("placement.devices_per_node",
                                  f"the job needs {needed} devices (trainer {parallel.world_size} + rollout "
                                  f"{self.rollout.replicas} x {self.rollout.tensor_parallel_size}) but "
                                  f"placement has {self.placement.nodes} x {self.placement.devices_per_node} = {have}")


    @property
    def serving_max_loras(self) -> int:
        """Adapters each replica holds: as set, but never fewer than the job's window of versions in flight + 1,
        plus a slot for each adapter teacher."""
        own = max(self.rollout.max_loras, staleness.adapter_window(self.loop.max_staleness) + 1)
        return own + sum(1 for t in self.distill.teachers if not t.model)

    @property
    def serving_lora_rank(self) -> int:
        """The rollout's max_lora_rank: as set, else the smallest vLLM rank that holds the trainer's and every
        teacher's whose adapter is there to read."""
        return self.rollout.max_lora_rank or serving_rank(max([self.trainer.lora.rank, *self.teacher_ranks()]))

    @property
    def eval_column(self) -> str:
        """The held-out rows' column the loop splits eval accuracy by (data.eval_by, else a distillation's route
        key), or ''."""
        if self.data.eval_by:
            return self.data.eval_by
        return self.distill.route_key if self.distill.teachers and self.distill.route == "domain" else ""

    def teacher_ranks(self) -> list[int]:
        """The LoRA rank of each teacher adapter that is there (adapter_config.json's r); the others are checked
        where the job's inputs are (lorarl.client.job.inputs.job_teachers)."""
        from lorarl.contract.peft import read_peft_config

        ranks = []
        for teacher in self.distill.teachers:
            if not teacher.adapter:  # a full model (an engine of its own) or a job's version (sized by its stack)
                continue
            try:
                ranks.append(int(read_peft_config(job_path(self, teacher.adapter))["r"]))
            except (ValueError, KeyError, TypeError):
                continue
        return ranks

    def _check_distill(self) -> None:
        """Teachers and a loss that reads them go together; each teacher is named once, has an adapter, and (routed
        by domain) a domain of its own; the rollout keeps its base pristine for them (adapters, never merged)."""
        d, loss = self.distill, self.trainer.loss
        if not d.teachers:
            if loss.distills:
                raise ConfigError("distill.teachers", f"is empty, but trainer.loss (type {loss.type}, distill_weight "
                                                      f"{loss.distill_scale}) distils: name the teachers")
            return
        if not loss.distills:
            raise ConfigError("trainer.loss.type", f"is {loss.type!r}, which does not read the {len(d.teachers)} "
                                                   "teacher(s) of distill.teachers: use 'opd', or set "
                                                   "trainer.loss.distill_weight above 0")
        seen: dict[str, int] = {}
        for i, teacher in enumerate(d.teachers):
            key = f"distill.teachers[{i}]"
            if not teacher.name:
                raise ConfigError(f"{key}.name", "is empty: each teacher needs a name")
            if teacher.name in seen:
                raise ConfigError(f"{key}.name", f"{teacher.name!r} names teacher {seen[teacher.name]} too")
            seen[teacher.name] = i
            if sum(map(bool, (teacher.adapter, teacher.model, teacher.job))) != 1:
                raise ConfigError(f"{key}.adapter", "and .model and .job: set exactly one — a PEFT LoRA adapter on "
                                                    "the job's base (scored in the student's engine), another job's "
                                                    "published adapter version (JOB@vN), or a full model directory "
                                                    "(served by an engine of its own)")
            if teacher.model:
                self._check_model_teacher(f"{key}.model")
            if teacher.job and teacher.job.rpartition("@v")[0] == self.job_id:
                raise ConfigError(f"{key}.job", f"names this job's own version ({teacher.job}): a teacher is another "
                                                "job's (this one's versions move as it trains, and --fresh drops them)")
            if d.route == "domain" and not teacher.domain:
                raise ConfigError(f"{key}.domain", f"is empty: with distill.route 'domain' each teacher names the "
                                                   f"value of the data's {d.route_key!r} column it scores")
        domains = [t.domain for t in d.teachers]
        if d.route == "domain" and len(set(domains)) != len(domains):
            raise ConfigError("distill.teachers", f"two teachers share a domain ({domains}): each domain has one")
        if d.route == "mixture" and not sum(t.weight for t in d.teachers) > 0:
            raise ConfigError("distill.teachers", "every weight is 0: a mixture needs one above 0")
        adapters = any(t.adapter or t.job for t in d.teachers)
        if adapters and (self.sync.mode == "merged" or self.rollout.enable_lora is False):
            raise ConfigError("sync.mode" if self.sync.mode == "merged" else "rollout.enable_lora",
                              "teachers are adapters on the pristine base, served beside the student's versions: "
                              "they need sync.mode adapter (or auto) and rollout.enable_lora")

    def version_teacher_key(self) -> str:
        """The key of the first teacher that is another job's version (distill.teachers[i].job), '' when none: for
        the launchers that start a stack of their own (no other job's versions on it) to refuse the job by it."""
        return next((f"distill.teachers[{i}].job" for i, t in enumerate(self.distill.teachers) if t.job), "")

    def model_teacher_key(self) -> str:
        """The key of the first full-model teacher (distill.teachers[i].model), '' when none: for the launchers that
        do not start such a teacher's engine (Slurm's script, several jobs on one stack) to refuse the job by it."""
        return next((f"distill.teachers[{i}].model" for i, t in enumerate(self.distill.teachers) if t.model), "")

    def _check_model_teacher(self, key: str) -> None:
        """Where a full-model teacher's engine can be started: by the local launcher, on a CPU host (its device
        on an accelerator is not planned yet), with the student's rollout engine kind."""
        if self.launcher.kind != "local":
            raise ConfigError(key, f"a full-model teacher's engine is started by the local launcher only "
                                   f"(launcher.kind is {self.launcher.kind!r}): make the teacher an adapter of the "
                                   "job's base, or run the job with launcher.kind local")
        if device_kind(self.trainer.device) != "cpu":
            raise ConfigError(key, f"a full-model teacher's engine runs on CPU hosts only for now (trainer.device is "
                                   f"{self.trainer.device!r}: its place on the devices is not planned yet); make "
                                   "the teacher an adapter of the job's base")

    def _check_colocate(self) -> None:
        """What placement.colocate cannot do, all at once: anything that would write the shared base, or a second
        process that would need a copy of it."""
        problems = []
        if self.sync.mode == "merged":
            problems.append("sync.mode is 'merged': each version would be written into the base the trainer "
                            "computes on; use sync.mode=adapter (the rollout serves the adapter over the shared base)")
        if self.rollout.enable_lora is False:
            problems.append("rollout.enable_lora is false: every version would be merged into the shared base")
        if device_kind(self.trainer.device) not in ("cpu", "cuda"):
            problems.append(f"trainer.device is {self.trainer.device!r}: one shared base is built for CPU hosts "
                            "(shared memory) and planned for CUDA (CUDA IPC); on Ascend each service loads its own "
                            "copy (README, 'LoRA RL on one GPU')")
        if self.rollout.engine != "vllm" or self.rollout.replicas != 1 or self.rollout.tensor_parallel_size != 1:
            problems.append(f"the rollout must be one vLLM replica at tensor parallel size 1 (engine "
                            f"{self.rollout.engine!r}, replicas {self.rollout.replicas}, tensor_parallel_size "
                            f"{self.rollout.tensor_parallel_size})")
        if self.trainer.parallel.world_size != 1 or self.trainer.parallel.pipeline != 1:
            problems.append("the trainer must be one process on one device (trainer.parallel all 1)")
        if self.launcher.kind != "local":
            problems.append("launcher.kind must be 'local': the shared base is memory of one host")
        if self.rollout.dtype and self.rollout.dtype != self.model.dtype:
            problems.append(f"rollout.dtype {self.rollout.dtype!r} differs from model.dtype {self.model.dtype!r}: "
                            "one copy has one dtype")
        if problems:
            raise ConfigError("placement.colocate", "; ".join(problems))

    def _check_ascend(self) -> None:
        """A job on NPUs is told up front what Ascend refuses (lorarl/common/ascend.py), all at once."""
        import os

        from lorarl.common import ascend

        if not ascend.is_npu(self.trainer.device):
            return
        problems = [*ascend.rollout_problems(self.rollout.block_size, self.model.dtype,
                                             block_key="rollout.block_size", dtype_key="model.dtype"),
                    *ascend.trainer_problems(self.trainer.engine, engine_key="trainer.engine"),
                    *ascend.environment_problems(os.environ)]
        if self.sync.mode == "merged":
            problems += ascend.merged_reload_problems(self.rollout.enforce_eager, eager_key="rollout.enforce_eager")
        elif self.rollout.enable_lora is not False:
            problems += ascend.lora_rank_problems(self.serving_lora_rank, rank_key="rollout.max_lora_rank")
        if problems:
            raise ConfigError("", f"on Ascend NPUs (trainer.device={self.trainer.device}): " + "; ".join(problems))


def load_job_config(path: str | None, overrides: list[str]) -> JobFileConfig:
    """The job file with its overrides, validated; ``job_dir`` (not a setting) is the file's folder, where the
    job's own reward and workflow modules and relative data paths are looked up first; ``model_name`` (not a
    setting either) is model.path as written, before it is resolved to a folder (``base_model_name``)."""
    from lorarl.common.config import load_config

    cfg = load_config(JobFileConfig, path, overrides=overrides, env={})
    cfg.job_dir = str(Path(path).resolve().parent) if path else ""
    cfg.model_name = cfg.model.path
    cfg.model.path = model_location(cfg.model.path, cfg.job_dir)
    return cfg


def base_model_name(cfg: JobFileConfig) -> str:
    """The base model as the job names it: model.path as the job file (or an override) wrote it, a Hugging Face
    Hub id staying a Hub id (``Qwen/Qwen3-8B``, not its snapshot folder in this host's cache). Exported adapters
    record it as ``base_model_name_or_path``, where PEFT loads the base from, as PEFT itself records the name a
    model was loaded by; a resumed run is compared by it (a moved checkout is the same model)."""
    return getattr(cfg, "model_name", "") or cfg.model.path


#: The folder lorarl is installed in: a shipped model's path (lorarl/assets/models/...) is found from any folder.
INSTALL_ROOT = Path(__file__).resolve().parents[3]


def model_location(path: str, job_dir: str) -> str:
    """model.path as found, made absolute: a relative path in the job file's folder first (as data and rewards
    are), then the current folder, then lorarl's own folder (the shipped models, so a job file naming one runs
    from anywhere), then a Hub model id's snapshot in the Hugging Face cache; as written when none holds it (a
    Hub model not cached yet, or a model the plan reads from model.shape)."""
    if not path or Path(path).is_absolute():
        return path
    for root in (job_dir, ".", str(INSTALL_ROOT)):
        if root and (Path(root) / path).exists():
            return str((Path(root) / path).resolve())
    from lorarl.client.job.hub import cached_model, is_repo_id

    if is_repo_id(path):  # a Hub model id: its snapshot in the Hugging Face cache (`lorarl run` downloads)
        return cached_model(path) or path
    return path


def job_path(cfg: JobFileConfig, path: str) -> str:
    """A relative path of the job file: from its folder when something is there, else as given (from the
    working directory, or a hub name)."""
    job_dir = getattr(cfg, "job_dir", "")
    if path and job_dir and not Path(path).is_absolute() and (Path(job_dir) / path).exists():
        return str(Path(job_dir) / path)
    return path


def training_spec(cfg: JobFileConfig, model_path: str) -> TrainingSpec:
    """What the job's trainer trains by (lorarl.contract.training), from the job file: the loss with what the
    loop decides (an async loop's staleness bound, the rollout's max_tokens), and limits that take every
    prompt and completion the rollout can return."""
    t = cfg.trainer
    megatron = MegatronSpec()
    if t.engine == "megatron":
        megatron = MegatronSpec(t.parallel.tensor, t.parallel.pipeline, t.parallel.expert)
    init = str(Path(job_path(cfg, t.init_adapter)).resolve()) if t.init_adapter else ""
    loss = loss_for_loop(t.loss, mode=cfg.loop.mode, max_staleness=cfg.loop.max_staleness,
                         max_tokens=cfg.rollout.max_tokens)
    try:
        return TrainingSpec(
            base_model_path=model_path, device=t.device, dtype=cfg.model.dtype, lora=t.lora.spec(), loss=loss,
            optimizer=t.optimizer, seed=t.seed, engine=t.engine, megatron=megatron, memory=t.memory,
            layer_devices=t.parallel.pipeline if t.engine == "torch" else 1, init_adapter_path=init,
            limits=LimitsSpec(max_sequence_tokens=max(serving_length(cfg) or 0, DEFAULT_MAX_SEQUENCE_TOKENS)),
            routing_replay=t.routing_replay, fingerprint_check=t.fingerprint_check, share=t.share,
            base_model_name=base_model_name(cfg))
    except SpecError as e:
        raise ConfigError(f"trainer.{e.path}", e.problem) from None


def is_moe(cfg) -> bool:
    """Whether the job's model routes tokens to experts (its config.json names experts)."""
    config = Path(cfg.model.path) / "config.json"
    if not config.is_file():
        return False
    fields = json.loads(config.read_text())
    fields = fields.get("text_config", fields)
    return bool(fields.get("num_experts") or fields.get("num_local_experts"))


def records_routes(cfg, moe: bool | None = None) -> bool:
    """Whether this job's rollouts record routed experts for the trainer to replay (trainer.routing_replay):
    a MoE model (``moe``; None: as model.path's config.json says) and vLLM rollouts, unless 'off'. Both trainer
    engines replay."""
    t = cfg.trainer
    return t.routing_replay != "off" and cfg.rollout.engine == "vllm" and (is_moe(cfg) if moe is None else moe)


def serving_length(cfg) -> int | None:
    """The rollout's max_model_len: rollout.max_model_len, else the smallest power of two >= 2048 that holds
    the longest prompt and completion, at most the model's own context (None: the model's, unknown here).
    vLLM refuses to start when its KV cache cannot hold one max_model_len sequence, and Qwen3's 40K
    default would make that most caches on a GPU."""
    if cfg.rollout.max_model_len:
        return cfg.rollout.max_model_len
    config = Path(cfg.model.path) / "config.json"
    if not config.is_file():
        return None
    context = json.loads(config.read_text()).get("max_position_embeddings")
    need = cfg.data.max_prompt_tokens + max(cfg.rollout.max_tokens, cfg.rollout.eval_max_tokens)
    length = max(2048, 1 << (need - 1).bit_length())
    return min(length, context) if context else length
