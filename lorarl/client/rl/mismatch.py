"""The mismatch alarm: the rollout-vs-trainer KL that grows while the learning rate stays flat.

The trainer reports KL(rollout || trainer) every step (``train/rollout_kl_k3``, lorarl.trainer.rl.correction),
and the same KL over the tokens its own version sampled (``train/rollout_kl_k3_current``). The alarm reads the
second: over stale tokens the KL also holds how far the policy moved since, which grows in a healthy async
run whose learning speeds up (a 40-step agent job tripped the alarm on it); over current tokens it is the
mismatch alone. A step with no current tokens (a trainer-bound async step) leaves the alarm as it was; the
served-policy guard (lorarl.client.rl.guard) checks every version whatever the loop's shape.
Learning moves the mismatch a little either way; one that rises step after step at a constant learning rate
is what a rollout serving the wrong weights looks like (a sync that never reached the serving layer: verl #7495 saw it
climb 36x while it read as staleness). The alarm fires on that shape, or on an absolute ceiling, and says
which: a warning in the log and ``policy/mismatch_alarm`` in the metrics, or, with ``action: fail``, the
end of the run.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque

from lorarl.client.job.config import MismatchAlarmSection

logger = logging.getLogger(__name__)

KL_KEY = "train/rollout_kl_k3_current"
LR_KEY = "train/lr"
#: Learning rates this close (relative) count as flat: a schedule's float noise is not a change.
FLAT_LR = 1e-6


class MismatchAlarmError(RuntimeError):
    """The run ended because its rollout-vs-trainer KL tripped the alarm (``action: fail``)."""


class MismatchAlarm:
    """Reads each step's metrics; ``check`` returns why it fires now, or None."""

    def __init__(self, settings: MismatchAlarmSection) -> None:
        self.settings = settings
        self._history: deque[tuple[float, float]] = deque(maxlen=settings.window + 1)

    def check(self, metrics: dict[str, float]) -> str | None:
        kl, lr = metrics.get(KL_KEY), metrics.get(LR_KEY)
        if kl is None or not math.isfinite(kl):
            return None
        s = self.settings
        if s.max_kl is not None and kl > s.max_kl:
            return f"rollout-vs-trainer KL {kl:.3g} is above loop.mismatch_alarm.max_kl = {s.max_kl:g}"
        if not s.window:
            return None
        self._history.append((kl, lr if lr is not None else math.nan))
        if len(self._history) <= s.window:
            return None
        kls = [k for k, _ in self._history]
        lrs = [r for _, r in self._history]
        rising = all(b > a for a, b in itertools.pairwise(kls)) and kls[0] >= s.floor
        flat = all(math.isfinite(r) for r in lrs) and max(lrs) - min(lrs) <= FLAT_LR * max(abs(v) for v in lrs)
        if rising and flat and kls[-1] >= s.growth * kls[0]:
            return (f"rollout-vs-trainer KL rose {s.window} steps in a row, {kls[0]:.3g} -> {kls[-1]:.3g} "
                    f"({kls[-1] / kls[0]:.1f}x) at a flat learning rate {lrs[-1]:g}: the rollout may be serving other "
                    "weights than the trainer's (check weight sync and the served adapter)")
        return None

    def observe(self, metrics: dict[str, float]) -> None:
        """Adds ``policy/mismatch_alarm`` (1 when it fires) to a step's metrics; logs, or raises with ``fail``."""
        reason = self.check(metrics)
        metrics["policy/mismatch_alarm"] = 1.0 if reason else 0.0
        if reason is None:
            return
        if self.settings.action == "fail":
            raise MismatchAlarmError(f"step {int(metrics.get('step', 0))}: {reason}")
        logger.warning("step %d: %s", int(metrics.get("step", 0)), reason)
