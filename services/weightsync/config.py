"""Configuration of the weight-sync service: `server:` (shared) and `weightsync:` (its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import in_range, setting
from services.common.server_config import ServerConfig


@dataclass
class WeightSyncSettings:
    """What the weight-sync service itself needs; later issues add transport settings."""

    storage_dir: str = setting("runs/weightsync", doc="Durable copies of published versions.")
    keep_versions: int = setting(3, check=in_range(1), doc="Versions kept per job on disk.")


@dataclass
class WeightSyncServiceConfig:
    """The whole weight-sync service config file."""

    server: ServerConfig = field(default_factory=ServerConfig)
    weightsync: WeightSyncSettings = field(default_factory=WeightSyncSettings)
