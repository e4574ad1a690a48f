"""Reward functions by name or by 'module:function': (completion_text, gold_answer) -> float.

A user's reward function may raise or return NaN on some completion; `GuardedReward` decides what
that costs: the sample scores 0 and is counted (`data.reward_errors: zero`, the default), or the run
ends with the function's error (`fail`).
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable
from typing import Literal

from lorarl.common.config import ConfigError

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
RewardErrors = Literal["zero", "fail"]
REWARD_ERRORS = ("zero", "fail")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 when the last number in the completion equals the gold number."""
    numbers = _NUMBER.findall(completion)
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1].replace(",", "")) == float(answer) else 0.0
    except ValueError:
        return 0.0


def load_reward(name: str) -> RewardFn:
    """'exact' etc. (lorarl.assets.tasks), 'gsm8k', or an importable 'package.module:function'."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError("data.reward", f"cannot import {name!r}: {e}") from None
        if not callable(fn):
            raise ConfigError("data.reward", f"{name!r} is not callable")
        return fn
    if name == "gsm8k":
        return gsm8k_reward
    from lorarl.assets.tasks import REWARD_FNS

    if name not in REWARD_FNS:
        raise ConfigError("data.reward", f"unknown reward {name!r}; known: {sorted([*REWARD_FNS, 'gsm8k'])} "
                                         "or 'module:function'")
    return REWARD_FNS[name]


class RewardError(RuntimeError):
    """A reward function failed and ``data.reward_errors`` is 'fail'."""


class GuardedReward:
    """``fn`` with its failures handled: an exception or a non-finite value scores 0 ('zero': counted in
    ``errors``, reported once with the first traceback) or raises RewardError ('fail')."""

    def __init__(self, fn: RewardFn, on_error: RewardErrors = "zero", name: str = "") -> None:
        if on_error not in REWARD_ERRORS:
            raise ConfigError("data.reward_errors", f"expected one of {list(REWARD_ERRORS)}, got {on_error!r}")
        self.fn, self.on_error, self.name = fn, on_error, name or getattr(fn, "__name__", "reward")
        self.errors = 0  # samples scored 0 for a failure, over the run
        self._reported = False

    def __call__(self, completion: str, answer: str) -> float:
        try:
            value = float(self.fn(completion, answer))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as exc:
            if self.on_error == "fail":
                raise RewardError(f"reward {self.name!r} failed: {type(exc).__name__}: {exc} "
                                  "(data.reward_errors=zero scores such samples 0 instead)") from exc
            self.errors += 1
            if not self._reported:
                self._reported = True
                logger.warning("reward %r failed (%s: %s); such samples score 0 and are counted in "
                               "rollout/reward_errors (data.reward_errors=fail ends the run instead)",
                               self.name, type(exc).__name__, exc, exc_info=True)
            return 0.0
        return value
