"""Which sync mode a job uses (adapter or merged), and how each replica serves a version.

AUTO picks ADAPTER only when every replica can load this adapter (LoRA support, rank, a free
slot): adapters are a few MB, merged weights the whole model. A replica that cannot serve LoRA is
still served in an ADAPTER job: it is told to merge the adapter into its base weights locally, unless several
jobs share it (caps.shared): such a replica is never given a version that writes its base (a merged job, an
adapter it cannot serve as one), and a job that would need one is refused at registration
(lorarl.contract.sharing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lorarl.contract import sharing
from lorarl.contract.sharing import EngineLora
from lorarl.v1 import common_pb2, weightsync_pb2

ADAPTER = common_pb2.SYNC_MODE_ADAPTER
MERGED = common_pb2.SYNC_MODE_MERGED
AUTO = common_pb2.SYNC_MODE_AUTO


@dataclass(frozen=True)
class ModeChoice:
    mode: int
    reason: str


def adapter_blocker(caps: weightsync_pb2.ReplicaCapabilities, lora: common_pb2.LoraSpec) -> str | None:
    """Why a replica cannot serve this adapter at run time, or None if it can."""
    if why := sharing.adapter_blocker(EngineLora.of(caps), lora.rank):
        return why
    if caps.max_loras < 1:
        return "max_loras is 0"
    return None


def sharing_blocker(caps: weightsync_pb2.ReplicaCapabilities, job_mode: int, lora: common_pb2.LoraSpec
                    ) -> str | None:
    """Why a replica that several jobs share (caps.shared) must not serve this job (it would write the base every
    job there samples from: lorarl.contract.sharing), or None."""
    if not caps.shared:
        return None
    return sharing.sharing_refusal(EngineLora.of(caps), lora.rank, merged=job_mode == MERGED)


def registration_refusal(requested: int, lora: common_pb2.LoraSpec,
                         replicas: Mapping[str, weightsync_pb2.ReplicaCapabilities]) -> str | None:
    """Why a job cannot be registered with the replicas subscribed now (a shared one it would write over)."""
    for rid, caps in sorted(replicas.items()):
        if why := sharing_blocker(caps, requested, lora):
            return f"replica {rid}: {why}"
    return None


def choose_mode(requested: int, lora: common_pb2.LoraSpec,
                replicas: Mapping[str, weightsync_pb2.ReplicaCapabilities]) -> ModeChoice:
    """Resolves AUTO against the replicas subscribed now; ADAPTER and MERGED are kept as asked."""
    if requested == ADAPTER:
        return ModeChoice(ADAPTER, "requested adapter")
    if requested == MERGED:
        return ModeChoice(MERGED, "requested merged")
    if not replicas:
        return ModeChoice(ADAPTER, "auto: no replica subscribed yet; adapter is the smallest payload "
                                   "(a replica without LoRA support merges it locally)")
    blockers = {rid: why for rid, caps in sorted(replicas.items()) if (why := adapter_blocker(caps, lora))}
    if blockers:
        listed = "; ".join(f"{rid}: {why}" for rid, why in blockers.items())
        return ModeChoice(MERGED, f"auto: merged because {listed}")
    return ModeChoice(ADAPTER, f"auto: adapter; all {len(replicas)} replicas serve LoRA rank {lora.rank}")


def serve_mode(job_mode: int, caps: weightsync_pb2.ReplicaCapabilities, lora: common_pb2.LoraSpec) -> int:
    """How one replica serves a job's versions: as an adapter, or merged (maybe merged locally)."""
    if job_mode == ADAPTER and adapter_blocker(caps, lora) is None:
        return ADAPTER
    return MERGED
