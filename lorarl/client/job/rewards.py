"""The job's reward: a shipped one by name or a user's 'module:function', called off the loop's event loop,
its failures handled.

A reward takes one of three forms, told apart by its first parameter's name:

    f(completion, answer)                          the shipped rewards ('exact', 'gsm8k', ...)
    f(prompt, completion, **columns) -> float      one sample; every column of the data row as keywords
    f(prompts, completions, **columns) -> list     a batch (an example's group); columns as lists

Each may be a plain or an ``async def`` function. A plain one runs on a thread pool of
``data.reward_workers`` threads, so a slow reward (a sandbox, a judge) does not stall generation or
training; an async one is awaited. A failure (an exception, a non-finite value, a batch of the wrong
length) costs what ``data.reward_errors`` says (`GuardedReward`): the sample scores 0 and is counted,
or the run ends with the function's error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from lorarl.client.job.datasets import gsm8k_gold
from lorarl.common.config import ConfigError

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
RewardErrors = Literal["zero", "fail"]
RewardForm = Literal["pair", "sample", "batch"]
REWARD_ERRORS = ("zero", "fail")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 when the last number in the completion equals the gold number. ``answer`` is the number, or a whole
    GSM8K solution ('... #### 72'), whose number is taken as data.source=gsm8k takes it: GSM8K read with
    data.source=datasets scores the same, instead of 0 for every sample."""
    numbers = _NUMBER.findall(completion)
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1].replace(",", "")) == float(gsm8k_gold(answer)) else 0.0
    except ValueError:
        return 0.0


def load_reward(name: str, job_dir: str = "") -> RewardFn:
    """'exact' etc. (lorarl.assets.tasks), 'gsm8k', or an importable 'package.module:function' (the job
    file's folder searched first)."""
    if ":" in name:
        from lorarl.client.job.imports import import_object

        fn = import_object(name, "data.reward", job_dir)
        if not callable(fn):
            raise ConfigError("data.reward", f"{name!r} is not callable")
        reward_form(fn)  # a signature it cannot call is an error now, not at the first sample
        return fn
    if name == "gsm8k":
        return gsm8k_reward
    from lorarl.assets.tasks import REWARD_FNS

    if name not in REWARD_FNS:
        raise ConfigError("data.reward", f"unknown reward {name!r}; known: {sorted([*REWARD_FNS, 'gsm8k'])} "
                                         "or 'module:function'")
    return REWARD_FNS[name]


def reward_form(fn: RewardFn) -> RewardForm:
    """Which of the three forms ``fn`` has (see the module docstring), from its parameters."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "pair"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = positional[0].name if positional else ""
    if first in ("prompts", "prompt"):
        if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
            second = "completions" if first == "prompts" else "completion"
            raise ConfigError("data.reward", f"{getattr(fn, '__name__', fn)!r} takes {first} but no completion "
                                             f"argument: write f({first}, {second}, **columns)")
        return "batch" if first == "prompts" else "sample"
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError("data.reward", f"{getattr(fn, '__name__', fn)!r} must take (completion, answer), "
                                         "(prompt, completion, **columns) or (prompts, completions, **columns)")
    return "pair"


def _keywords(fn: RewardFn) -> tuple[bool, frozenset[str]]:
    """(takes **kwargs, the keyword names it takes)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params), frozenset(
        p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


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
        """``fn(completion, answer)``, checked (the shipped rewards' form, called in place)."""
        try:
            outcome: Any = self.fn(completion, answer)
        except Exception as exc:
            outcome = exc
        return self.check(outcome)[0]

    def check(self, outcome: Any) -> tuple[float, bool]:
        """(score, failed) for what one call returned, or the exception it raised."""
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            value = float(outcome)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
            return value, False
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
            return 0.0, True


class Reward:
    """The job's reward as episodes call it, ``await reward.score(example, completions)``: the function's
    form resolved once, plain functions on a thread pool, async ones awaited, every value checked."""

    def __init__(self, fn: RewardFn, on_error: RewardErrors = "zero", name: str = "", workers: int = 4) -> None:
        self.guard = GuardedReward(fn, on_error, name)
        self.fn, self.form = fn, reward_form(fn)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        self._any_keyword, self._keywords = _keywords(fn) if self.form != "pair" else (False, frozenset())
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reward")

    @property
    def errors(self) -> int:
        return self.guard.errors

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _columns(self, example: Any) -> dict[str, Any]:
        """The row's columns as keywords: all of them for ``**columns``, else those the function names."""
        columns = {**example.columns, "answer": example.answer}
        reserved = {"prompt", "completion", "prompts", "completions"}
        return {k: v for k, v in columns.items()
                if k not in reserved and (self._any_keyword or k in self._keywords)}

    async def _call(self, *args: Any, **kwargs: Any) -> Any:
        """The function's result, or the exception it raised (never raised here)."""
        try:
            if self.is_async:
                return await self.fn(*args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: self.fn(*args, **kwargs))
        except Exception as exc:
            return exc

    async def score(self, example: Any, completions: Sequence[str]) -> tuple[list[float], int]:
        """One score per completion of ``example``, and how many of them failed."""
        if isinstance(completions, str | bytes):
            raise TypeError("score takes a list of completions, not one string: score(example, [text])")
        if not completions:
            return [], 0
        if self.form == "pair":
            outcomes = await asyncio.gather(*(self._call(c, example.answer_text()) for c in completions))
        elif self.form == "sample":
            columns = self._columns(example)
            outcomes = await asyncio.gather(*(self._call(example.prompt, c, **columns) for c in completions))
        else:
            n = len(completions)
            batch = await self._call([example.prompt] * n, list(completions),
                                     **{k: [v] * n for k, v in self._columns(example).items()})
            if isinstance(batch, BaseException):
                outcomes = [batch] * n
            elif isinstance(batch, str | bytes) or not hasattr(batch, "__len__") or len(batch) != n:
                size = len(batch) if hasattr(batch, "__len__") else type(batch).__name__
                outcomes = [ValueError(f"returned {size} for a batch of {n} completions")] * n
            else:
                outcomes = list(batch)
        checked = [self.guard.check(outcome) for outcome in outcomes]
        return [value for value, _ in checked], sum(failed for _, failed in checked)
