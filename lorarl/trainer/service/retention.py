"""Checkpoint retention: a job that checkpoints every K steps for days keeps the newest few, not all.

Only directories named ``step-<N>`` (what the RL loop and the trainer's default name their periodic
checkpoints) are counted and removed; "resume", an export or any name a user chose is never touched.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)
STEP_NAME = re.compile(r"step-(\d+)")


def prune_step_checkpoints(saved: Path, keep_last: int) -> list[Path]:
    """Removes the older ``step-N`` checkpoints beside ``saved`` so that the newest ``keep_last`` remain
    (``saved`` counts among them when it is one, and is never removed); returns what was removed."""
    if keep_last < 1:
        return []
    steps = sorted((int(m.group(1)), p) for p in saved.parent.iterdir()
                   if p.is_dir() and p != saved and (m := STEP_NAME.fullmatch(p.name)))
    keep_others = keep_last - 1 if STEP_NAME.fullmatch(saved.name) else keep_last
    doomed = [p for _, p in (steps[:-keep_others] if keep_others else steps)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed checkpoint %s (keep_last %d)", path, keep_last)
    return doomed
