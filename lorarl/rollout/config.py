"""Configuration of the rollout service: `server:` (shared) and `rollout:` (its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lorarl.common.config import ConfigError, all_of, existing_dir, in_range, multiple_of, setting
from lorarl.common.cpu_affinity import check_cpu_setting, cpu_list
from lorarl.common.server_config import ServerConfig
from lorarl.contract.lora import VLLM_LORA_RANKS

EngineKind = Literal["vllm", "hf"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
AdapterSource = Literal["memory", "shm"]
UpdatePolicy = Literal["finish", "continue"]
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


@dataclass
class RolloutSettings:
    """What one rollout replica serves and how (engine, memory, adapter window, limits)."""

    model_path: str | None = setting(
        None, check=existing_dir, doc="Local Hugging Face model directory served by the engine (null: no engine)."
    )
    replica_id: str | None = setting(None, doc="Name reported to weight sync; default: host-pid.")
    engine: EngineKind = setting("vllm", doc="'vllm' (continuous batching) or 'hf' (transformers, one at a time).")
    device: str = setting("cpu", doc="Torch device for the hf engine; vLLM picks its platform itself.")
    dtype: DType = setting("auto", doc="Weights and activations dtype; 'auto' keeps the checkpoint's.")
    max_model_len: int | None = setting(None, check=in_range(16), doc="Context length; default: the model's.")
    kv_cache_gib: float | None = setting(
        None, check=in_range(0.0625), doc="KV cache size in GiB (vLLM); null: 1 GiB on CPU, and on GPUs what "
        "gpu_memory_utilization leaves once the weights are loaded.")
    gpu_memory_utilization: float | None = setting(
        None, check=in_range(0.05, 1.0), doc="Share of each GPU's memory the vLLM engine may use (weights, "
        "activations, KV cache); null: vLLM's default (0.9). Ignored on CPU.")
    tensor_parallel_size: int = setting(1, check=in_range(1, 64), doc="Devices one vLLM engine spans (TP).")
    max_num_batched_tokens: int | None = setting(
        None, check=in_range(16), doc="Tokens vLLM schedules per step (longer prefills are chunked); default: vLLM's.")
    long_prefill_tokens: int | None = setting(
        None, check=in_range(1), doc="vLLM: the most tokens of one request's prefill computed in one step when "
        "others share it (long_prefill_token_threshold; the rest in later steps). A distilling job's teachers read "
        "whole completions as prefills and ask every position's logprobs: `lorarl run` sets 32 for them, which "
        "bounds each step's full-vocabulary logits and keeps the engine's peak memory near a plain job's. Default: "
        "no cap.")
    max_num_seqs: int = setting(64, check=in_range(1), doc="Sequences vLLM runs in one step at most.")
    block_size: int | None = setting(
        None, check=all_of(in_range(16), multiple_of(16)),
        doc="Tokens per KV-cache block (a multiple of 16); prefix caching shares whole blocks, so prompts "
            "shorter than a block are prefilled once per sample. Default: vLLM's (128 on CPU).")
    engine_cpus: str = setting(
        "", check=cpu_list, doc="CPUs of the process running vLLM's engine core, every thread, as a Linux CPU "
        "list ('0', '0-3'); with vLLM in-process that is this service's process. Empty: unpinned. `lorarl run` "
        "sets it on CPU jobs (placement.pin_cpus).")
    enforce_eager: bool | None = setting(
        None, doc="Skip torch.compile and CUDA graph capture; null: true on CPU (vLLM CPU runs eager), false "
        "on GPUs, where captured graphs make decoding several times faster (at a slower start).")
    seed: int = setting(0, check=in_range(0), doc="Engine seed (requests without a seed draw from it).")
    enable_lora: bool | None = setting(
        None, doc="Start the engine with LoRA; null: yes unless the model cannot run LoRA on this platform."
    )
    max_lora_rank: int = setting(16, doc=f"Largest adapter rank the engine accepts; one of {VLLM_LORA_RANKS}.")
    max_loras: int = setting(4, check=in_range(1), doc="Adapters the engine holds at once (all jobs together).")
    shared: bool = setting(
        False, doc="Several jobs sample from this engine (a Tinker front, `lorarl run A B`): a version that would "
        "replace its base weights (a merged job, or an adapter it cannot serve as one) is refused, never merged over "
        "the others (lorarl.contract.sharing). false: one job's rollout, which may merge its adapter locally."
    )
    shared_base: str = setting(
        "", doc="The co-located job's shared base (placement.colocate; set by the launcher, which holds it): the "
        "engine's weights are that memory, shared with the trainer, never a copy; it serves adapters only "
        "(merged weights, or an adapter merged locally, would write the trainer's base) and takes each version "
        "from the trainer's memory file. vLLM on CPU, tensor parallel size 1 only.")
    adapter_window: int | None = setting(
        None, check=in_range(1), doc="Versions of one job kept loaded (>= staleness bound + 2); null: max_loras."
    )
    adapter_source: AdapterSource = setting(
        "memory", doc="'memory': adapters go to vLLM as bytes (worker extension); 'shm': PEFT dirs in shm_dir."
    )
    shm_dir: str = setting("/dev/shm", doc="tmpfs directory for adapter_source 'shm'.")
    update_policy: UpdatePolicy = setting(
        "finish",
        doc="Adapter jobs: requests following the latest version 'finish' on the version they started with, "
        "or are interrupted and 'continue' on the new one. Merged jobs always continue.",
    )
    logprobs_mode: LogprobsMode = setting(
        "processed_logprobs", doc="Logprobs after temperature/top-k/top-p ('processed') or of the raw logits."
    )
    max_logprobs: int = setting(20, check=in_range(0), doc="Largest SamplingParams.logprobs accepted.")
    max_n: int = setting(64, check=in_range(1), doc="Largest SamplingParams.n (GRPO group size) accepted.")
    default_max_tokens: int = setting(256, check=in_range(1), doc="max_tokens when a request leaves it 0.")
    max_queued_requests: int = setting(
        1024, check=in_range(1), doc="Sequences (prompts x n) admitted at once; beyond: RESOURCE_EXHAUSTED."
    )
    max_job_tokens_in_flight: int = setting(
        0, check=in_range(0), doc="Per job (the base model counts as one): tokens admitted at once, each sequence "
        "counted as its prompt + max_tokens; beyond: RESOURCE_EXHAUSTED for that job only, so one job's flood "
        "leaves the others room on a shared fleet (0: no per-job quota)."
    )
    base_fingerprint: str | None = setting(
        None, doc="Identity of the base model; default: computed from model_path like the trainer does."
    )
    weightsync_address: str = setting("", doc="host:port of the weight-sync service to follow (empty: none).")
    teacher_engines: dict[str, str] = setting(
        default_factory=dict, doc="On-policy distillation's full-model teachers: name -> host:port of the rollout "
        "service that serves that teacher's own model (its own engine: another base, the same tokenizer). A "
        "Generate request's teacher with that engine name is scored there, by the stack's token and peer TLS; "
        "adapter teachers are scored in this engine.")
    collective_backends: list[str] = setting(
        default_factory=lambda: ["gloo"], doc="Collective backends this replica can join ('gloo', 'nccl', 'hccl'); "
        "empty: inline transfers only."
    )
    advertise_address: str = setting("", doc="host:port (or host, with the bound port) the RL loop and other "
                                     "clients reach this replica's gRPC at, advertised through weight sync; empty: "
                                     "server.host, or the local address of the route to weight sync when bound to "
                                     "every interface.")
    sync_host: str = setting("", doc="Address the trainer's collective group reaches this replica at "
                                     "(empty: the local address of the route to weight sync).")
    openai_port: int | None = setting(
        None, check=in_range(0, 65535), doc="Port of the OpenAI-compatible HTTP endpoint (/v1/chat/completions, "
        "/v1/completions, /v1/models, /v1/sessions/ID) on server.host, with the same bearer token; 0: any free "
        "port (in the ready file as openai_port); null: off.")
    openai_max_sessions: int = setting(4096, check=in_range(1), doc="Sessions (episodes) the endpoint keeps the "
                                                                     "turns of; the least recently used go first.")
    receive_in_worker: Literal["auto", "on", "off"] = setting(
        "auto", doc="vLLM: the engine's worker joins the weight-transfer group itself and receives into its own "
        "device memory, this service keeping the control plane ('auto': on NPUs and GPUs, off on CPU). "
        "The engine steps no further while its worker receives (with vLLM in-process, as on CPU, neither "
        "does this service's event loop), where this service's own receive overlaps generation. Versions "
        "this replica merges itself (adapters served merged) are always received here.")
    record_routes: bool = setting(
        False, doc="MoE models on vLLM: record the experts every router chooses for every token and return them "
        "with each completion (Completion.routed_experts), for routing replay in the trainer (R3). The engine then "
        "starts without prefix caching (a cached position is never computed, so it has no route).")
    max_recorded_requests: int = setting(8192, check=in_range(1), doc="Requests whose routes the engine holds "
                                         "until their completion is returned; past it the oldest lose theirs.")

    def validate(self) -> None:
        unknown = sorted(set(self.collective_backends) - {"gloo", "nccl", "hccl"})
        if unknown:
            raise ConfigError("collective_backends", f"unknown backends {unknown}; use gloo, nccl or hccl")
        if self.engine_cpus:
            if self.engine != "vllm":
                raise ConfigError("engine_cpus", f"pins vLLM's engine core; engine is {self.engine!r} (use "
                                  "server.cpus for the whole service)")
            check_cpu_setting("engine_cpus", self.engine_cpus)
        if self.shared_base and (self.engine != "vllm" or self.tensor_parallel_size != 1):
            raise ConfigError("shared_base", "needs engine 'vllm' at tensor_parallel_size 1 (one process maps the "
                              f"shared base); engine is {self.engine!r}, tensor_parallel_size "
                              f"{self.tensor_parallel_size}")
        if self.record_routes and self.engine != "vllm":
            raise ConfigError("record_routes", f"needs engine 'vllm' (engine is {self.engine!r})")
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError("max_lora_rank", f"expected one of {VLLM_LORA_RANKS}, got {self.max_lora_rank}")
        if self.adapter_window is not None and self.adapter_window > self.max_loras:
            raise ConfigError(
                "adapter_window", f"{self.adapter_window} versions cannot fit in max_loras={self.max_loras}"
            )

    def base_write_refusal(self) -> str:
        """Why nothing may write this engine's base weights ('' when a version may): the base is the co-located
        trainer's memory (shared_base), or every job on a shared rollout samples from it (shared)."""
        if self.shared_base:
            return ("its base is the co-located trainer's shared copy (rollout.shared_base), which the trainer "
                    "computes on: a co-located rollout serves adapters only")
        if self.shared:
            return "every other job samples from it: a shared rollout (rollout.shared) serves adapters only"
        return ""

    @property
    def window(self) -> int:
        """Versions of one job kept loaded as adapters."""
        return self.adapter_window or self.max_loras


@dataclass
class RolloutServiceConfig:
    """The whole rollout service config file."""

    server: ServerConfig = field(default_factory=ServerConfig)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
