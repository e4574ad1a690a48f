"""Configuration of the trainer service: `server:` (shared) and `trainer:` (its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import matches, setting
from services.common.server_config import ServerConfig


@dataclass
class TrainerSettings:
    """What the trainer itself needs; later issues add model, memory and engine settings."""

    device: str = setting(
        "cpu",
        check=matches(r"cpu|cuda(:\d+)?|npu(:\d+)?", "a device like 'cpu', 'cuda', 'cuda:1' or 'npu'"),
        doc="Where base models and adapters live.",
    )
    checkpoint_dir: str = setting("runs/trainer/checkpoints", doc="Default directory for checkpoints.")


@dataclass
class TrainerServiceConfig:
    """The whole trainer service config file."""

    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
