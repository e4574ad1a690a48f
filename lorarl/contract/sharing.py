"""Which jobs can share one stack, and what a rollout engine that several jobs sample from may be given: the
one rule the multi-job launcher (`lorarl run A B`), `--attach`, the Tinker front, the trainer's CreateJob and
weight sync all apply.

A shared engine serves each job's versions as LoRA adapters beside one base. Anything that would write that
base is refused where the job is created, never merged: a merged job (its versions are whole weights), and an
adapter the engine cannot serve as one (an engine without LoRA, a rank above its ``max_lora_rank``). Merged
over the base, it would change what every other job samples, and their requests would fail ("the engine's
weights are replaced by merged ..."). A single-job stack may still merge locally: nobody else samples there.

Jobs on one stack must also agree on what its services are built from (``SHARED_KEYS``): the services are
started once, from the first job's file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.contract.lora import serving_rank

#: What every job on one stack must agree on (dotted job-file keys): the services are started once, from these.
SHARED_KEYS = ("model.path", "model.dtype", "rollout.engine", "rollout.dtype", "rollout.tensor_parallel_size",
               "rollout.replicas", "rollout.block_size", "rollout.enable_lora", "trainer.device", "trainer.engine",
               "sync.collective", "launcher.kind")
#: The setting that raises the adapter rank a rollout serves (job file and `lorarl serve rollout` alike).
RANK_SETTING = "rollout.max_lora_rank"
#: Why a merged job cannot share a rollout, whatever the rollout serves.
MERGED_REFUSAL = ("a merged job's versions replace the base weights every other job on this rollout samples from: "
                  "jobs share a rollout in adapter mode only (sync.mode=adapter)")
#: The LoRA rank the official Tinker SDK creates a training client with when none is given.
TINKER_SDK_DEFAULT_RANK = 32


@dataclass(frozen=True)
class EngineLora:
    """What a rollout engine serves as adapters: whether it has LoRA layers at all (and why not), the largest
    rank, and whether several jobs sample from it."""

    supports_lora: bool
    max_lora_rank: int
    shared: bool = False
    engine: str = ""
    why_not: str = ""  # the engine's own reason when it has no LoRA

    @classmethod
    def of(cls, caps: Any) -> EngineLora:
        """From a rollout's GetCapabilitiesResponse or a replica's ReplicaCapabilities (the same fields)."""
        return cls(bool(caps.supports_lora), int(caps.max_lora_rank), bool(caps.shared), str(caps.engine),
                   str(getattr(caps, "reason", "")))

    @property
    def no_lora(self) -> str:
        """The engine named, and why it has no LoRA."""
        engine = f"engine ({self.engine})" if self.engine else "engine"
        return f"{engine} does not support LoRA ({self.why_not or 'supports_lora=false'})"


def adapter_blocker(engine: EngineLora, rank: int) -> str | None:
    """Why ``engine`` cannot serve an adapter of ``rank`` as an adapter at run time, or None if it can."""
    if not engine.supports_lora:
        return engine.no_lora
    if engine.max_lora_rank < rank:
        return f"max_lora_rank {engine.max_lora_rank} < rank {rank}"
    return None


def sharing_refusal(engine: EngineLora, rank: int, merged: bool = False) -> str | None:
    """Why a job (LoRA ``rank``; ``merged``: it syncs whole weights) cannot sample from an engine other jobs
    share, naming the rank, the limit and the setting that raises it; None when it can."""
    if merged:
        return MERGED_REFUSAL
    if not engine.supports_lora:
        return (f"this rollout is shared by several jobs and its {engine.no_lora}: an adapter would be merged into "
                "the base every other job samples from, so it is refused; give the job a stack of its own")
    if rank > engine.max_lora_rank:
        return (f"LoRA rank {rank} is above the rank this shared rollout serves "
                f"({RANK_SETTING}={engine.max_lora_rank}); an adapter it cannot serve would be merged into the base "
                f"every other job samples from, so it is refused: use rank <= {engine.max_lora_rank}, or start the "
                f"rollout with {RANK_SETTING}={serving_rank(rank)} or more")
    return None


def shared_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """A job file's ``SHARED_KEYS`` values from its nested form (lorarl.common.config.to_dict, a run's
    config.json), the model path resolved."""
    values = {}
    for dotted in SHARED_KEYS:
        value: Any = config
        for part in dotted.split("."):
            value = value[part]
        values[dotted] = str(Path(value).resolve()) if dotted == "model.path" else value
    return values


def disagreement(jobs: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[str, str] | None:
    """(key, message) for the first ``SHARED_KEYS`` value the (job id, nested config) ``jobs`` differ on, or a
    job that syncs merged weights; None when they can share one stack."""
    first_id, first = jobs[0][0], shared_values(jobs[0][1])
    for job_id, config in jobs:
        if config["sync"]["mode"] == "merged":
            return "sync.mode", f"job {job_id}: {MERGED_REFUSAL}"
        values = shared_values(config)
        for key in SHARED_KEYS:
            if values[key] != first[key]:
                return key, (f"jobs {first_id} and {job_id} differ ({first[key]!r} vs {values[key]!r}); jobs on one "
                             "stack share the services built from it")
    return None
