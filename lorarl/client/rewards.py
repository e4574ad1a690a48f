"""Reward functions by name or by 'module:function': (completion_text, gold_answer) -> float."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from lorarl.common.config import ConfigError

RewardFn = Callable[[str, str], float]
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
