"""Configuration of the trainer service: `server:` (shared) and `trainer:` (its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorarl.common.config import ConfigError, existing_file, in_range, matches, setting
from lorarl.common.server_config import ServerConfig


@dataclass
class TenantKey:
    """A key that may use only the jobs it names (lorarl.trainer.service.tenancy)."""

    name: str = setting("", doc="Who holds the key (errors and logs name it, never the key).")
    token: str | None = setting(None, doc="The key itself (prefer token_file or token_env).")
    token_file: str | None = setting(None, check=existing_file, doc="File whose stripped content is the key.")
    token_env: str = setting("", doc="Environment variable holding the key.")
    jobs: list[str] = setting(default_factory=list, doc="Job ids the key may create and use: exact ids or "
                                                         "shell-style patterns ('team-a-*').")

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("name", "is required (who holds this key)")
        if not self.jobs:
            raise ConfigError("jobs", "names no job: list the job ids (or patterns) this key may use")


@dataclass
class TrainerSettings:
    """What the trainer process itself needs (per-job settings arrive with CreateJob)."""

    device: str = setting(
        "cpu",
        check=matches(r"cpu|cuda(:\d+)?|npu(:\d+)?", "a device like 'cpu', 'cuda', 'cuda:1' or 'npu'"),
        doc="Default device for jobs that do not name one.",
    )
    checkpoint_dir: str = setting("runs/trainer/checkpoints",
                                  doc="Checkpoints are written under this directory (relative paths resolve here).")
    export_dir: str = setting("runs/trainer/exports",
                              doc="Exports are written under this directory (relative paths resolve here).")
    model_roots: list[str] = setting(default_factory=list,
                                     doc="If set, base models must lie under one of these directories.")
    max_jobs: int = setting(4, check=in_range(1, 1024), doc="Jobs held at once.")
    max_job_tokens_in_flight: int = setting(
        0, check=in_range(0), doc="Per job: tokens (prompt + completion) of its training and logprob calls "
        "accepted and not yet answered, queued or running; beyond: RESOURCE_EXHAUSTED for that job, so a job "
        "that floods calls holds neither the trainer's memory nor its queue (0: no per-job quota).")
    weightsync_address: str = setting("", doc="host:port of the weight-sync service, for PublishWeights.")
    shared_base: str = setting("", doc="The co-located job's shared base (placement.colocate; set by the launcher, "
                               "which holds it): a job on that model computes on it instead of a copy of its own, "
                               "and hands its adapters to the co-located rollout by memory file.")
    sender_host: str = setting("", doc="Address rollout replicas reach this trainer at for collective transfers "
                                       "(empty: the local address of the route to the weight-sync service).")
    collective: bool = setting(True, doc="Send weights over a collective group (False: inline gRPC only).")
    bucket_mb: int = setting(1024, check=in_range(1, 1 << 20), doc="Collective bucket size in MiB.")
    ranks: int = setting(1, check=in_range(1, 1024),
                         doc="Trainer processes on this host: this one serves gRPC as rank 0 and starts ranks "
                             "1..N-1 itself. Under torchrun its WORLD_SIZE decides (leave this at 1).")
    rank_timeout_s: float = setting(1800.0, check=in_range(1.0, None),
                                    doc="Bound on one collective between trainer ranks (and on their rendezvous).")
    tenants: list[TenantKey] = setting(default_factory=list, doc="Per-job keys: each may use only the jobs it "
                                       "names (the server's own token still reaches every job).")
    compute_nice: int = setting(0, check=in_range(0, 19),
                                doc="Niceness added to the threads that run engine work (steps, checkpoints, "
                                    "exports) but not to the gRPC ones: a CPU trainer sharing cores with "
                                    "generation yields them while its RPCs keep their priority.")
    malloc_mmap_threshold_mib: int = setting(
        8, check=in_range(0, 512),
        doc="Host allocations this large (MiB) and larger get pages of their own, handed back when freed "
            "(lorarl.common.malloc_arenas.fix_mmap_threshold): a CPU trainer's peak then holds its step, not also "
            "the last step's freed heap. 0: glibc's own sliding threshold. $MALLOC_MMAP_THRESHOLD_, when set, wins.")


@dataclass
class TrainerServiceConfig:
    """The whole trainer service config file."""

    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
