"""Policy versions: how every service numbers a job's policies, in one place.

    v0            the base model (adapters off): what a fresh job is and every replica already serves
    v1, v2, ...   one per optimiser step, published to weight sync in order with no gaps (next = latest + 1);
                  a warm start's adapter is v1 before any step
    selector 0    in a request's policy selector, "the job's latest" — a selector never asks for the base
                  model by number (it names no job instead)

A job's versions may run ahead of its steps (a warm start, or a resume that continues above the numbers
weight sync already holds): ``version = step + base``, and the loop keeps ``base`` to know which version
a batch trains.
"""

from __future__ import annotations

BASE = 0
FIRST = 1
#: A policy selector's version meaning "the job's latest".
LATEST = 0


def publishable(version: int) -> bool:
    """Whether ``version`` names trained weights weight sync can hold (the base model is never published)."""
    return version >= FIRST


def next_version(latest: int) -> int:
    """The only version that may follow ``latest`` (an optimiser step, a publish, a resume above it)."""
    return latest + 1


def previous(version: int) -> int:
    """The version before ``version``: what a job had published when it reached ``version``."""
    return version - 1


def base_of(version: int, step: int) -> int:
    """How far a job's versions run ahead of its steps."""
    return version - step


def trained_by(step: int, base: int) -> int:
    """The version step ``step`` (0-based) trains: the policy its batch was admitted against."""
    return step + base
