"""Real gloo transfer group across processes: one sender, two receivers, verified buckets."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from lorarl.common.ports import free_port
from lorarl.v1 import common_pb2
from lorarl.weightsync.wire.collective import WeightTransferGroup
from lorarl.weightsync.wire.payload import build_manifest, pack, unpack_bucket
from tests.support.workers import worker_context

pytestmark = pytest.mark.slow


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(f"t{i}", torch.randn(3000 + i, generator=g).to(torch.bfloat16 if i % 2 else torch.float32))
            for i in range(9)]


def receiver(rank: int, port: int, manifest_bytes: bytes, queue: mp.Queue) -> None:
    manifest = common_pb2.WeightManifest.FromString(manifest_bytes)
    group = WeightTransferGroup("gloo", "127.0.0.1", port, rank, 3, "t", timeout_s=60)
    got = {}
    for bucket in manifest.buckets:
        buf = group.receive(bucket.nbytes)
        got.update({n: t.clone().float().sum().item() for n, t in unpack_bucket(manifest, bucket.index, buf)})
    queue.put((rank, got))


def test_broadcast_buckets_to_two_receivers() -> None:
    buckets = list(pack(tensors(), bucket_bytes=16_000))
    assert len(buckets) >= 3
    manifest = build_manifest(job_id="j", version=1, mode=common_pb2.SYNC_MODE_ADAPTER,
                              base_model_fingerprint="f", buckets=buckets)
    port = free_port()
    ctx = worker_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(r, port, manifest.SerializeToString(), queue)) for r in (1, 2)]
    for p in procs:
        p.start()
    group = WeightTransferGroup("gloo", "127.0.0.1", port, 0, 3, "t", timeout_s=60)  # blocks until all join
    sent = group.send(iter(buckets))
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sent == manifest.total_bytes
    want = {n: t.float().sum().item() for n, t in tensors()}
    assert results[1] == want and results[2] == want


def piecewise_receiver(rank: int, port: int, manifest_bytes: bytes, queue: mp.Queue) -> None:
    from lorarl.weightsync.client.agent import verify_pieces

    manifest = common_pb2.WeightManifest.FromString(manifest_bytes)
    group = WeightTransferGroup("gloo", "127.0.0.1", port, rank, 3, "p", timeout_s=60, local_address="127.0.0.1",
                                piece_bytes=1000)
    pieces = group.receive_pieces([b.nbytes for b in manifest.buckets])
    got = verify_pieces(manifest, pieces)
    queue.put((rank, {n: t.clone().float().sum().item() for n, t in got.items()}))
    group.close()


def test_buckets_travel_in_pieces_verified_as_they_land() -> None:
    """Buckets of ~16 kB in 1000-byte pieces, on a store the sender made first (port 0), pinned to loopback."""
    from lorarl.weightsync.wire.collective import rendezvous_store

    buckets = list(pack(tensors(), bucket_bytes=16_000))
    manifest = build_manifest(job_id="j", version=1, mode=common_pb2.SYNC_MODE_ADAPTER,
                              base_model_fingerprint="f", buckets=buckets)
    store = rendezvous_store("127.0.0.1", 60)
    ctx = worker_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=piecewise_receiver, args=(r, store.port, manifest.SerializeToString(), queue))
             for r in (1, 2)]
    for p in procs:
        p.start()
    group = WeightTransferGroup("gloo", "127.0.0.1", store.port, 0, 3, "p", timeout_s=60,
                                local_address="127.0.0.1", store=store, piece_bytes=1000)
    assert group.send(iter(buckets)) == manifest.total_bytes
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want = {n: t.float().sum().item() for n, t in tensors()}
    assert results[1] == want and results[2] == want
    group.close()


def two_rank_groups(name: str) -> dict[int, WeightTransferGroup]:
    """Ranks 0 and 1 of a gloo group on loopback, built side by side in two threads of this process."""
    import threading

    from lorarl.weightsync.wire.collective import rendezvous_store

    store = rendezvous_store("127.0.0.1", 30)
    groups: dict[int, WeightTransferGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = WeightTransferGroup("gloo", "127.0.0.1", store.port, rank, 2, name, timeout_s=30,
                                           local_address="127.0.0.1", store=store if rank == 0 else None)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups


def test_close_without_waiting_shuts_the_group_down_in_the_background(monkeypatch: pytest.MonkeyPatch) -> None:
    """close(wait=False) returns while gloo's shutdown (~20 ms) is still running, and the shutdown does run."""
    import threading

    from lorarl.weightsync.wire import collective

    release, closed = threading.Event(), []
    original = collective._shutdown

    def held_shutdown(pg) -> None:
        release.wait(30)
        original(pg)
        closed.append(pg)

    monkeypatch.setattr(collective, "_shutdown", held_shutdown)
    groups = two_rank_groups("bg")
    buf = torch.arange(10, dtype=torch.uint8)
    got = torch.zeros(10, dtype=torch.uint8)
    work = groups[1].broadcast(got, 0)
    groups[0].broadcast(buf, 0).wait()
    work.wait()
    assert torch.equal(got, buf)
    for g in groups.values():
        g.close(wait=False)  # returns although the shutdown is held
    assert closed == [] and all(g._pg is None for g in groups.values())
    release.set()
    assert collective.wait_closed(30)
    assert len(closed) == 2


def test_wait_closed_returns_only_once_background_closed_groups_are_destroyed(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """A process exiting while a gloo group is being destroyed aborts ("terminate called without an active
    exception"), so waiting must cover the destruction after the shutdown, not just the shutdown."""
    import time
    import weakref

    from lorarl.weightsync.wire import collective

    original = collective._shutdown

    def slow_after_shutdown(pg) -> None:  # the shutdown is done; the group is still alive a while
        original(pg)
        time.sleep(0.5)

    monkeypatch.setattr(collective, "_shutdown", slow_after_shutdown)
    groups = two_rank_groups("gone")
    refs = [weakref.ref(g._pg) for g in groups.values()]
    for g in groups.values():
        g.close(wait=False)
    time.sleep(0.2)  # both shutdowns have returned; the groups are not destroyed yet
    assert collective.wait_closed(30)
    assert [r() for r in refs] == [None, None]
    assert not collective._CLOSING


def test_closers_that_ended_are_not_kept() -> None:
    """A replica closes a group per version without ever calling wait_closed: ended closer threads are
    dropped as new ones start, so the set does not grow with the run."""
    import threading

    from lorarl.weightsync.wire import collective

    class Group:  # a stand-in process group: close() only calls its shutdown()
        def __init__(self) -> None:
            self.down = threading.Event()

        def shutdown(self) -> None:
            self.down.set()

    for _ in range(5):
        group = object.__new__(WeightTransferGroup)
        pg = Group()
        group._pg, group._store = pg, None
        group.close(wait=False)
        assert pg.down.wait(10)
        for closer in list(collective._CLOSING):
            closer.join(10)
    assert len(collective._CLOSING) <= 1
