"""Tolerances from the measured spread of a computation, not from one run's figure.

Two fp32 computations of the same logprobs in different orders (TP=2 vs TP=1, two ranks vs one) each
stray from the exact value by rounding; how far is measured here against the same engine in float64.
Their difference is at most the sum of the two errors, so a layout is held to SPREAD_FACTOR times the
one-process spread (2 for the two errors, 2 for the largest error landing on another token), with a
floor of a few fp32 ulps of the largest value for a spread that came out near zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SPREAD_FACTOR = 4.0
ULP_FLOOR = 8  # fp32 ulps of the largest |value|


def fp64_logprobs(engine, records: Sequence, **kwargs) -> list[list[float]]:
    """``engine.compute_logprobs`` with the model (base and adapters) cast to float64, then cast back
    (fp32 -> fp64 -> fp32 is exact, so the engine is left as it was)."""
    engine.model.double()
    try:
        return engine.compute_logprobs(records, **kwargs)
    finally:
        engine.model.float()


def max_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def spread_bound(fp32: Sequence[Sequence[float]], fp64: Sequence[Sequence[float]]) -> float:
    """How far another fp32 layout may differ from ``fp32``: see the module docstring."""
    largest = max(abs(x) for row in fp64 for x in row)
    floor = ULP_FLOOR * torch.finfo(torch.float32).eps * largest
    return max(SPREAD_FACTOR * max_diff(fp32, fp64), floor)
