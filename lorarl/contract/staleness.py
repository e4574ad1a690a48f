"""The staleness rule, the one place the loop, the trainer and the local stack read it from.

A token sampled by policy version v may train the policy at version t only if t - v <= bound
(`loop.max_staleness`). Three parts keep to it:
- the loop admits batch b (trained at version b) only once the served version is >= b - bound, so
  an admitted batch never holds a token that breaks the rule (`admits`);
- the trainer masks any token that would break it anyway (a resumed run, a replica that lagged), so
  the rule holds whatever the client does (`fresh`, with `loss.max_staleness = bound`);
- a rollout keeps `adapter_window(bound)` versions of a job loaded: the batches still decoding use
  bound + 1 versions at most (from b - bound up to b, while batch b is awaited), and the next version
  stages beside them before it commits.
Sync loops are the bound-0 case: every token comes from the version it trains."""

from __future__ import annotations

from typing import TypeVar

Versions = TypeVar("Versions")  # an int, or a tensor of token versions


def fresh(trainer_version: int, token_versions: Versions, bound: int) -> Versions:
    """Whether tokens sampled at ``token_versions`` may train version ``trainer_version`` (elementwise)."""
    return (trainer_version - token_versions) <= bound  # type: ignore[operator, return-value]


def admits(served_version: int, batch_index: int, bound: int) -> bool:
    """Whether batch ``batch_index`` may start generating while ``served_version`` serves."""
    return served_version >= batch_index - bound


def adapter_window(bound: int) -> int:
    """How many versions of one job a rollout keeps loaded to serve a loop with this bound."""
    return bound + 2
