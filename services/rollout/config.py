"""Configuration of the rollout service: `server:` (shared) and `rollout:` (its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import existing_dir, in_range, setting
from services.common.server_config import ServerConfig


@dataclass
class RolloutSettings:
    """What the rollout replica itself needs; later issues add engine and sampling settings."""

    model_path: str | None = setting(
        None, check=existing_dir, doc="Local Hugging Face model directory served by the engine."
    )
    replica_id: str | None = setting(None, doc="Name reported to weight sync; default: host-pid.")
    max_loras: int = setting(4, check=in_range(1), doc="Adapters held by the engine at once.")


@dataclass
class RolloutServiceConfig:
    """The whole rollout service config file."""

    server: ServerConfig = field(default_factory=ServerConfig)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
