"""A user's object named in a job file ('package.module:name'), imported with the job file's folder first
on the import path, so a reward or workflow kept beside the job needs no PYTHONPATH."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lorarl.common.config import ConfigError


def import_object(spec: str, key: str, job_dir: str = "") -> Any:
    """``spec``'s object; a ConfigError under ``key`` says what could not be found, and where it looked."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or not all(part.isidentifier() for part in [*module_name.split("."), attr]):
        raise ConfigError(key, f"{spec!r}: expected 'package.module:name'")
    if job_dir and job_dir not in sys.path:
        sys.path.insert(0, job_dir)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail however it likes: say where and why
        where = f"the job file's folder {job_dir} and " if job_dir else ""
        raise ConfigError(key, f"cannot import {module_name!r} (looked in {where}sys.path): "
                               f"{type(e).__name__}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(key, f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no {attr!r}") from None
