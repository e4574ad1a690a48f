"""Configuration of the weight-sync service: `server:` (shared) and `weightsync:` (its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lorarl.common.config import in_range, setting
from lorarl.common.server_config import ServerConfig


@dataclass
class WeightSyncSettings:
    """What the weight-sync service itself needs: storage, transports and the activation timeouts."""

    storage_dir: str = setting("runs/weightsync", doc="Durable copies of published versions.")
    keep_versions: int = setting(3, check=in_range(1), doc="Versions kept per job on disk.")
    transport: Literal["collective", "inline"] = setting(
        "collective", doc="collective: broadcast over a transfer group when trainer and replica can; inline: gRPC only."
    )
    collective_backend: Literal["gloo", "nccl", "hccl"] = setting(
        "gloo", doc="Backend of the weight-transfer group: gloo (CPU), nccl (CUDA), hccl (Ascend)."
    )
    collective_timeout_s: float = setting(
        120.0, check=in_range(1), doc="Timeout of the transfer group's rendezvous and broadcasts."
    )
    stage_timeout_s: float = setting(
        300.0, check=in_range(0.1), doc="A round fails if its replicas have not staged (or activated) by then."
    )
    disconnect_grace_s: float = setting(
        5.0, check=in_range(0), doc="A replica whose stream drops while staging fails the round after this."
    )
    chunk_bytes: int = setting(1 << 20, check=in_range(1024, 64 << 20), doc="Inline chunk size (FetchWeights).")
    tick_s: float = setting(0.2, check=in_range(0.01, 5), doc="How often timeouts are checked.")


@dataclass
class WeightSyncServiceConfig:
    """The whole weight-sync service config file."""

    server: ServerConfig = field(default_factory=ServerConfig)
    weightsync: WeightSyncSettings = field(default_factory=WeightSyncSettings)
