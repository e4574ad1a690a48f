"""What the loop asks the rollout replicas before a job starts: settings that run but quietly mislead.

A rollout serving another dtype than the trainer trains in (the example service config once left
``rollout.dtype: auto``, bf16 for most checkpoints, against an fp32 job) generates and learns, but
its behaviour logprobs differ from the trainer's by the dtype's rounding, which the decoupled loss
then reads as off-policy drift. The loop warns, naming both keys, and goes on.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from lorarl.v1 import rollout_pb2


async def rollout_warnings(cfg: Any, replicas: Sequence[Any]) -> list[str]:
    """One line per replica whose served dtype differs from ``model.dtype`` (printed on stderr too)."""
    warnings = []
    for replica in replicas:
        caps = await replica.GetCapabilities(rollout_pb2.GetCapabilitiesRequest(), timeout=60)
        if caps.dtype and caps.dtype != cfg.model.dtype:
            where = getattr(replica, "address", "") or "a rollout replica"
            warnings.append(f"the rollout at {where} serves {caps.dtype} while the trainer trains in "
                            f"{cfg.model.dtype} (model.dtype): behaviour logprobs will differ by the rounding; "
                            f"start the rollout with rollout.dtype={cfg.model.dtype}")
    for line in warnings:
        print(f"lorarl: warning: {line}", file=sys.stderr, flush=True)
    return warnings
