"""Episodes: the interface a job's workflow implements, the single-turn GRPO episode, and loading one by name."""

from __future__ import annotations

from typing import Any

from lorarl.client.workflow.api import Episode, EpisodeContext, Sampled, Workflow
from lorarl.common.config import ConfigError

__all__ = ["Episode", "EpisodeContext", "Sampled", "Workflow", "load_workflow"]

#: Workflows the package ships, by the name a job file may give instead of 'module:Class'.
SHIPPED = {"single_turn": "lorarl.client.workflow.single_turn:SingleTurn"}


def load_workflow(name: str, settings: dict[str, Any], job_dir: str = "") -> Workflow:
    """The workflow a job names, built with its settings; a ConfigError under ``workflow.*`` otherwise."""
    from lorarl.client.job.imports import import_object

    cls = import_object(SHIPPED.get(name, name), "workflow.name", job_dir)
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ConfigError("workflow.name", f"{name!r} is not a lorarl.client.workflow.Workflow subclass")
    try:
        return cls(**settings)
    except TypeError as e:
        raise ConfigError("workflow.settings", f"{name}: {e}") from None
