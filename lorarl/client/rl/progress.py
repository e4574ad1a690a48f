"""The progress bar of a run: step, reward, accuracy (``acc``: the share of samples whose reward is >=
loop.success_reward, 1 by default), mean response length, policy version lag, the KL to the reference (``kl_ref``:
train/kl_ref, when the loss has a KL term), the rollout-vs-trainer mismatch (``mismatch``: train/rollout_kl_k3, k3
KL between the logprobs the rollout sampled with and the trainer's, not the KL to the reference), throughput and
ETA. Each label is its metric's name in metrics.jsonl (lorarl.client.rl.metric_names says the scheme); evaluation
lines and the summary name the success rule.

On a terminal it is one line redrawn in place (evaluations print above it and stay); when the
output is a file or a pipe (CI logs, `| tee`), every step prints its own line, since carriage
returns would only garble the log.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

from lorarl.client.rl import metric_names as names

BAR_WIDTH = 24


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[#########.......]`` with ``done/total`` of the width filled."""
    filled = 0 if total <= 0 else min(width, int(width * done / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


class ProgressBar:
    """Renders train-step and eval metric dicts (the loop's rows) as a progress display."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, clock=time.monotonic,
                 success_reward: float = 1.0) -> None:
        """``success_reward``: the job's loop.success_reward, said beside each held-out accuracy (a reader must
        not guess what counts as correct)."""
        self.total = total_steps
        self.success_reward = success_reward
        self.stream = stream or sys.stdout
        self.clock = clock
        self.started = clock()
        self.first_step: int | None = None
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._live = False  # a redrawn line is on screen

    def steps_per_s(self, step: int) -> float:
        """Throughput over the steps this process ran (a resumed run starts counting at its first step)."""
        if self.first_step is None:
            return 0.0
        elapsed = self.clock() - self.started
        return (step - self.first_step) / elapsed if elapsed > 0 else 0.0

    def render_step(self, m: dict[str, float]) -> str:
        step = int(m.get("step", 0))
        rate = self.steps_per_s(step)
        eta = f"ETA {format_duration((self.total - step) / rate)}" if rate > 0 and step < self.total else ""
        parts = [
            f"{bar(step, self.total)} {step}/{self.total}",
            f"reward {m.get(names.REWARD_MEAN, 0):.3f}",
            f"acc {m.get(names.ACCURACY, 0):.3f}",
            f"len {m[names.RESPONSE_LENGTH_MEAN]:.0f}" if names.RESPONSE_LENGTH_MEAN in m else "",
            f"v{int(m.get(names.VERSION, 0))} lag {int(m.get(names.VERSION_LAG, 0))}",
            f"kl_ref {m[names.KL_REF]:.1e}" if names.KL_REF in m else "",
            f"mismatch {m[names.MISMATCH]:.1e}{' (!)' if m.get(names.MISMATCH_ALARM) else ''}"
            if names.MISMATCH in m else "",
            f"{m.get(names.TOKENS_PER_S, 0):.0f} tok/s",
            f"{rate:.2f} step/s" if rate else "",
            format_duration(m.get("time_s", 0)),
            eta,
        ]
        return "  ".join(p for p in parts if p)

    def render_eval(self, m: dict[str, float]) -> str:
        return (f"[eval] step {int(m.get('step', 0))}/{self.total}  held-out accuracy {m[names.EVAL_ACCURACY]:.3f} "
                f"(reward >= {self.success_reward:g})  mean reward {m[names.EVAL_MEAN_REWARD]:.3f}  "
                f"({format_duration(m.get('time_s', 0))})")

    def update(self, m: dict[str, float]) -> None:
        if names.EVAL_ACCURACY in m:
            self._println(self.render_eval(m))
            return
        if self.first_step is None:
            # The rate counts from the step before this one: the time since the bar was created.
            self.first_step = int(m.get("step", 0)) - 1
        line = self.render_step(m)
        if not self.tty:
            self._println(line)
            return
        width = shutil.get_terminal_size((120, 20)).columns
        self.stream.write("\r" + line[: width - 1].ljust(width - 1))
        self.stream.flush()
        self._live = True

    def _println(self, line: str) -> None:
        if self._live:
            self.stream.write("\n")
            self._live = False
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._live:
            self.stream.write("\n")
            self.stream.flush()
            self._live = False
