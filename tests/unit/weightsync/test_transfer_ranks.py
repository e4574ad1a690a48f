"""How many ranks a replica holds in a transfer (lorarl/contract/transfer_ranks.py), and the round's ranks
weight sync plans from it."""

from __future__ import annotations

import pytest

from lorarl.contract.transfer_ranks import held_ranks, merges_locally, ranks_for_version
from lorarl.v1 import common_pb2

ADAPTER, MERGED = common_pb2.SYNC_MODE_ADAPTER, common_pb2.SYNC_MODE_MERGED


@pytest.mark.parametrize(("advertised", "manifest", "serve", "held"), [
    (0, ADAPTER, ADAPTER, 1),  # older replicas send no count: one rank
    (1, MERGED, MERGED, 1),
    (2, ADAPTER, ADAPTER, 2),  # a TP-2 engine receiving in its workers
    (2, MERGED, MERGED, 2),
    (4, ADAPTER, MERGED, 1),  # merged here from the adapter: the rollout service receives alone
])
def test_ranks_for_version(advertised: int, manifest: int, serve: int, held: int) -> None:
    assert ranks_for_version(advertised, manifest, serve) == held
    assert merges_locally(manifest, serve) == (manifest == ADAPTER and serve == MERGED)


def test_held_ranks_run_from_the_first_in_worker_order() -> None:
    assert held_ranks(3, 0) == [3]
    assert held_ranks(1, 2) == [1, 2]
    assert held_ranks(5, 3) == [5, 6, 7]
