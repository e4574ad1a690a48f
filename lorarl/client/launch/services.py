"""The services a job gets: their config sections (what `lorarl run`, the compose files, Slurm and the benchmarks
start alike), CPU pins and device masks, and the stack that starts them on this host or a Ray cluster."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lorarl.client.job.config import job_path, records_routes, serving_length
from lorarl.client.launch.local import teacher_engine_process
from lorarl.client.launch.log_files import LogRetention
from lorarl.common.config import ConfigError
from lorarl.contract import staleness
from lorarl.platform import backend_for, device_kind


def rollout_lora(cfg) -> bool | None:
    """rollout.enable_lora for this job's rollouts: the job file's, else off in a merged job (its rollouts
    serve merged weights only: no LoRA layers to hold, and on NPUs no MoE-LoRA limits), else the engine's
    own default (None: on where the model can run LoRA)."""
    if cfg.rollout.enable_lora is not None:
        return cfg.rollout.enable_lora
    return False if cfg.sync.mode == "merged" else None


def decode_wave(cfg) -> int:
    """rollout.max_num_seqs for this job: its own, else a step's whole batch (prompts x group) in one decode
    wave on every replica (at least 64)."""
    return cfg.rollout.max_num_seqs or max(64, -(-cfg.loop.prompts_per_step * cfg.rollout.group_size
                                                 // cfg.rollout.replicas))


#: rollout.long_prefill_tokens of a distilling CPU job: a teacher's row is prefilled this many tokens a step at most,
#: so a step's logits over the vocabulary stay small (bench/distill_memory.py; measured on CPU only, so not set on
#: accelerators, where it would also chunk long prompts for a memory figure nobody has taken).
TEACHER_PREFILL_TOKENS = 32


def stack_sections(cfg, out: Path) -> dict[str, dict[str, Any]]:
    """Service config sections for a local stack serving this job."""
    window = staleness.adapter_window(cfg.loop.max_staleness)
    # Weights move over the accelerator's own collective when there is one (untested here: CPU only).
    backend = backend_for(cfg.trainer.device)
    return {
        "weightsync": {"storage_dir": str(out / "weightsync" / f"launch-{int(time.time())}"),
                       "collective_backend": backend},
        # A CPU trainer shares the cores with generation: its engine threads at niceness 10 do not preempt
        # the rollout engine's step loop, while its gRPC threads keep their normal priority.
        # Co-located, each version reaches the rollout as a memory file of the trainer: no collective group.
        "trainer": {"device": cfg.trainer.device, "checkpoint_dir": str(out / "checkpoints"),
                    **({"compute_nice": 10} if cfg.trainer.device == "cpu" else {}),
                    "export_dir": str(out / "exports"),
                    "collective": cfg.sync.collective and not cfg.placement.colocate,
                    # one process per rank (rank 0 serves gRPC); a torch layer split is one process
                    **({"ranks": ranks} if (ranks := cfg.trainer.parallel.ranks(cfg.trainer.engine)) > 1 else {}),
                    # distillation's teachers are jobs of their own beside the student's (adapters on its base)
                    **({"max_jobs": 4 + len(cfg.distill.teachers)} if cfg.distill.teachers else {})},
        "rollout": {"model_path": str(Path(cfg.model.path).resolve()), "engine": cfg.rollout.engine,
                    "dtype": cfg.rollout.dtype or cfg.model.dtype,
                    **({"record_routes": True} if records_routes(cfg) else {}),
                    "kv_cache_gib": cfg.rollout.kv_cache_gib, "max_lora_rank": cfg.serving_lora_rank,
                    "max_loras": cfg.serving_max_loras, "adapter_window": window,
                    "replica_id": "rollout-0",
                    "tensor_parallel_size": cfg.rollout.tensor_parallel_size,
                    **({"openai_port": 0} if cfg.rollout.openai else {}),
                    **({"block_size": cfg.rollout.block_size} if cfg.rollout.block_size else {}),
                    **({"max_model_len": length} if (length := serving_length(cfg)) else {}),
                    **{key: getattr(cfg.rollout, key) for key in ("enforce_eager", "gpu_memory_utilization")
                       if getattr(cfg.rollout, key) is not None},
                    **({"enable_lora": lora} if (lora := rollout_lora(cfg)) is not None else {}),
                    "receive_in_worker": cfg.rollout.receive_in_worker,
                    "max_num_seqs": decode_wave(cfg),
                    # teachers read whole completions as prefills with every position's logprobs: in pieces
                    **({"long_prefill_tokens": TEACHER_PREFILL_TOKENS}
                       if cfg.distill.teachers and device_kind(cfg.trainer.device) == "cpu" else {}),
                    "collective_backends": sorted({backend, "gloo"})},
    }


#: A student rollout's settings a full-model teacher's engine leaves out: it serves its own model, no adapters, no
#: versions, no endpoint, no pins (lorarl.client.launch.local starts it as process "teacher-<name>").
NOT_FOR_TEACHER_ENGINES = ("max_lora_rank", "max_loras", "adapter_window", "openai_port", "record_routes",
                           "engine_cpus", "shared_base", "weightsync_address", "receive_in_worker")


def teacher_engine_sections(cfg, rollout: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each full-model teacher's engine (distill.teachers[].model): the student's rollout section (``rollout``)
    for another model, without LoRA — the teacher's weights are a copy of their own, by the job's choice."""
    return {t.name: {**{k: v for k, v in rollout.items() if k not in NOT_FOR_TEACHER_ENGINES},
                     "model_path": str(Path(job_path(cfg, t.model)).resolve()), "enable_lora": False,
                     "replica_id": teacher_engine_process(t.name)}
            for t in cfg.distill.teachers if t.model}


def cpu_pins(cfg) -> dict[str, str]:
    """CPU lists for a CPU job's two busiest processes (placement.pin_cpus 'auto'). An async loop
    generates while it trains: vLLM's engine core on the first half of the CPUs this process may use,
    the trainer on the rest. A sync loop takes turns (generate, then train), so each takes every CPU
    while the other waits: at the Qwen3-0.6B shape on 2 cores a step fell from 36 s to 31 s (generation
    19 -> 13 s; bench/RESULTS.md). The rollout frontend, weight sync and the loop stay where the OS puts
    them. Empty when off, on accelerators, with several rollout replicas, tensor-parallel rollout workers (each
    is bound to CPUs of its own: lorarl/rollout/vllm/cpu_binding.py) or trainer ranks, or on one CPU."""
    from lorarl.common.cpu_affinity import available_cpus, format_cpu_list

    cpus = available_cpus()
    if (cfg.placement.pin_cpus != "auto" or cfg.trainer.device != "cpu" or cfg.rollout.engine != "vllm"
            or cfg.rollout.replicas > 1 or cfg.rollout.tensor_parallel_size > 1
            or cfg.trainer.parallel.world_size > 1 or len(cpus) < 2):
        return {}
    if cfg.loop.mode == "sync":
        return {"rollout_engine": format_cpu_list(cpus), "trainer": format_cpu_list(cpus)}
    half = len(cpus) // 2
    return {"rollout_engine": format_cpu_list(cpus[:half]), "trainer": format_cpu_list(cpus[half:])}


def pinned_threads(pins: dict[str, str]) -> dict[str, dict[str, str]]:
    """OpenMP threads of the pinned processes: one per CPU each is pinned to (the other services keep one:
    two threads per process on two cores made a step 20x slower while all three computed at once).
    Several threads wait passively: threads spinning between ops took the CPUs from the other services'
    Python threads, and a sync demo job (8 steps) took 54 s instead of 34; passive, 32 s."""
    from lorarl.common.cpu_affinity import parse_cpu_list

    env = {}
    for process, key in (("trainer", "trainer"), ("rollout", "rollout_engine")):
        if key in pins:
            threads = len(parse_cpu_list(pins[key]))
            env[process] = {"OMP_NUM_THREADS": str(threads), **({"OMP_WAIT_POLICY": "PASSIVE"} if threads > 1 else {})}
    return env


#: Why a co-located job on a GPU is planned (--dry-run) but not started: what runs and what does not.
COLOCATE_NOT_BUILT = (
    "on CUDA it is planned (--dry-run prints the one-card budget) but not started yet: the CUDA IPC handoff "
    "(lorarl/platform/cuda_ipc.py) and the trainer's device aliasing are built, for bench/one_base_gpu.py to check "
    "on one GPU with the HF engine (not run on a GPU yet), but vLLM CUDA loading its weights from the shared buffer "
    "is not (no CUDA vLLM to test it with); run the job with placement.colocate=false (each service its own copy), "
    "or on a CPU host")


def check_startable(cfg) -> None:
    """ConfigError for a job the plan accepts but `lorarl run` cannot start yet (a co-located job on CUDA)."""
    if cfg.placement.colocate and device_kind(cfg.trainer.device) != "cpu":
        raise ConfigError("placement.colocate", COLOCATE_NOT_BUILT)
    if key := cfg.version_teacher_key():
        raise ConfigError(key, version_teacher_refusal(cfg))


def version_teacher_refusal(cfg) -> str:
    """Why a job whose teacher is another job's version (JOB@vN) cannot run on a stack it starts itself."""
    job = next(t.job for t in cfg.distill.teachers if t.job)
    return (f"job {cfg.job_id}: {job} is read from the weight sync its job published to, and a stack this run starts "
            "holds no other job's versions: run this job on that stack (`lorarl run JOB.yaml --attach RUN_DIR` of "
            "the run it trains or trained in, while its services are up; or `lorarl train --weightsync ...`), or "
            "give the teacher as an export of that job (adapter:)")


def local_stack(cfg, out: Path, sections: dict[str, dict[str, Any]] | None = None):
    """The services `lorarl run` starts for this job, not yet started (benchmarks start the same);
    ``sections``: other services' settings than this job's own (several jobs on one stack)."""
    from lorarl.client.launch.local import LocalStack

    check_startable(cfg)
    sections = sections if sections is not None else stack_sections(cfg, out)
    pins = cpu_pins(cfg)
    if pins:
        sections["rollout"]["engine_cpus"] = pins["rollout_engine"]
    threads = 1 if cfg.trainer.device == "cpu" else max(1, (os.cpu_count() or 2) // 3)
    return LocalStack(out / "services", sections, threads_per_service=threads, rollout_replicas=cfg.rollout.replicas,
                      shared_base_model=str(Path(cfg.model.path).resolve()) if cfg.placement.colocate else "",
                      process_env={**visible_devices(cfg), **pinned_threads(pins)},
                      server_sections={"trainer": {"cpus": pins["trainer"]}} if pins else {},
                      log_retention=log_retention(cfg), metrics=cfg.output.prometheus,
                      metrics_host=cfg.output.prometheus_host,
                      teacher_engines=teacher_engine_sections(cfg, sections.get("rollout", {})))


def log_retention(cfg) -> LogRetention:
    """How much of each service log the job keeps (output.service_log_mib, output.service_log_backups)."""
    return LogRetention.from_mib(cfg.output.service_log_mib, cfg.output.service_log_backups)


def metrics_line(stack, out: Path) -> str:
    """The line `lorarl run` prints once the services are up, naming each one's Prometheus endpoint
    (output.prometheus); "" when they serve none."""
    urls = stack.metrics_urls()
    if not urls:
        return ""
    return ("lorarl: Prometheus metrics at " + ", ".join(f"{name} {url}" for name, url in urls.items())
            + f" (also in {out / 'services' / 'stack.json'})")


def launch_stack(cfg, out: Path):
    """The services of this job, not yet started: on this host, or placed on a Ray cluster (launcher.kind)."""
    if cfg.launcher.kind == "ray":
        from lorarl.client.launch.ray_cluster import RayStack

        out = out.resolve()  # the actors' working folders are not this process's
        threads = 1 if cfg.trainer.device == "cpu" else max(1, int(cfg.launcher.cpus_per_service))
        return RayStack(cfg, out, stack_sections(cfg, out), threads_per_service=threads,
                        log_retention=log_retention(cfg))
    return local_stack(cfg, out)


def visible_devices(cfg) -> dict[str, dict[str, str]]:
    """Per-process device masks from the placement plan (one node, accelerators only)."""
    from lorarl.client.job.plan import place

    device = cfg.trainer.device.split(":", 1)[0]
    if not cfg.placement.devices_per_node or device == "cpu":
        return {}
    variable = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}[device]
    masks = {}
    for slot in place(cfg):
        name = slot.role if slot.role == "trainer" or cfg.rollout.replicas > 1 else "rollout"
        masks[name] = {variable: ",".join(str(d) for d in slot.devices)}
    return masks
