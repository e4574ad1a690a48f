"""The one error a contract spec raises for a bad setting, so every surface can name the setting its own way."""

from __future__ import annotations


class SpecError(ValueError):
    """A bad setting: ``field`` is its name in the class that refused it, ``path`` its dotted path from the
    training spec (``optimizer.learning_rate``), ``problem`` what is wrong with it. The job file puts it
    under ``trainer.``, the trainer's gRPC servicer under ``config.`` (INVALID_ARGUMENT)."""

    def __init__(self, section: str, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        self.path = f"{section}.{field}" if section else field
        super().__init__(f"{self.path} {problem}")
