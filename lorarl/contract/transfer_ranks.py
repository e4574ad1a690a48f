"""How many ranks a replica holds in a version's collective transfer: one rule for weight sync, which
assigns them, and the rollout, whose processes join with them.

A replica whose engine receives in its own workers (rollout.receive_in_worker with tensor or pipeline
parallel workers) joins with one rank per worker, every worker receiving the full tensors and loading
its own shard; a version it merges itself (an adapter served merged) passes through the rollout
service, which joins alone.
"""

from __future__ import annotations

from lorarl.v1 import common_pb2


def merges_locally(manifest_mode: int, serve_mode: int) -> bool:
    """An adapter version served as merged weights: the replica merges it from the values it received."""
    return serve_mode == common_pb2.SYNC_MODE_MERGED and manifest_mode == common_pb2.SYNC_MODE_ADAPTER


def ranks_for_version(receiving_ranks: int, manifest_mode: int, serve_mode: int) -> int:
    """Ranks a replica advertising ``receiving_ranks`` (0 meaning 1) holds for one version."""
    return 1 if merges_locally(manifest_mode, serve_mode) else max(1, receiving_ranks)


def held_ranks(first: int, count: int) -> list[int]:
    """The ranks of a StageEvent's (rank, rank_count), in worker order."""
    return list(range(first, first + max(1, count)))
