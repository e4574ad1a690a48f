"""The real WeightSyncService in-process with the publisher and in-process agents: statuses on the
wire, AUTO resolution, late joiners, inline and mixed transports, catch-up retries, restart."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from lorarl.common.errors import FIELD_METADATA_KEY
from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.client.agent import WeightSyncAgent
from lorarl.weightsync.client.publisher import PublishError, WeightPublisher
from lorarl.weightsync.client.sinks import MERGED, InMemorySink
from lorarl.weightsync.wire.payload import build_manifest, pack
from tests.integration.weightsync.harness import TOKEN, eventually, running_service
from tests.integration.weightsync.tiny import FINGERPRINT, TinyTrainer, lora_spec

pytestmark = pytest.mark.timeout(180)
ADAPTER_MODE = common_pb2.SYNC_MODE_ADAPTER
GLOO = common_pb2.COLLECTIVE_BACKEND_GLOO


def caps(lora: bool = True, collective: bool = True, engine: str = "test") -> weightsync_pb2.ReplicaCapabilities:
    return weightsync_pb2.ReplicaCapabilities(supports_lora=lora, max_lora_rank=64, max_loras=2, engine=engine,
                                              collective_backends=[GLOO] if collective else [])


@contextlib.asynccontextmanager
async def agent(target: str, replica_id: str, sink: InMemorySink | None = None, **kwargs) -> AsyncIterator[
        tuple[WeightSyncAgent, InMemorySink]]:
    sink = sink if sink is not None else InMemorySink()
    kwargs.setdefault("capabilities", caps())
    a = WeightSyncAgent(target, sink, replica_id=replica_id, token=TOKEN, reconnect_max_s=0.5, **kwargs)
    task = asyncio.create_task(a.run())
    try:
        await eventually(lambda: a.connected, 10, f"{replica_id} subscribed")
        yield a, sink
    finally:
        a.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


def run(coro) -> None:
    asyncio.run(coro)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def registered(pub: WeightPublisher, trainer: TinyTrainer, job: str = "job",
                     mode: int = ADAPTER_MODE):
    return await pub.register_job(job, base_model_fingerprint=FINGERPRINT, lora=lora_spec(),
                                  catalog=trainer.catalog(), mode=mode)


def test_refusals_carry_the_right_status_and_field(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running_service(tmp_path) as (running, _), WeightPublisher(running.address, token=TOKEN,
                                                                               collective=False) as pub:
            trainer = TinyTrainer()
            await registered(pub, trainer)
            trainer.step(1)
            first = await pub.publish("job", 1, adapter=trainer.adapter())
            assert first.activation.ok and first.transport == "inline" and first.receivers == 0

            def manifest(version: int, fingerprint: str = FINGERPRINT, **tensors: torch.Tensor):
                items = tensors or trainer.adapter()
                return build_manifest(job_id="job", version=version, mode=ADAPTER_MODE,
                                      base_model_fingerprint=fingerprint, buckets=list(pack(items.items())),
                                      lora=lora_spec())

            async def refused(m: common_pb2.WeightManifest) -> grpc.aio.AioRpcError:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pub.stub.PublishManifest(weightsync_pb2.PublishManifestRequest(manifest=m))
                return info.value

            gap = await refused(manifest(3))
            assert gap.code() == grpc.StatusCode.FAILED_PRECONDITION and "version gap" in gap.details()
            wrong_base = await refused(manifest(2, fingerprint="sha256:other"))
            assert wrong_base.code() == grpc.StatusCode.FAILED_PRECONDITION
            trainer.step(7)
            conflict = await refused(manifest(1))  # version 1 again, with other content
            assert conflict.code() == grpc.StatusCode.ALREADY_EXISTS
            bad_shape = await refused(manifest(2, **{
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 3),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}))
            assert bad_shape.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(bad_shape.trailing_metadata())[FIELD_METADATA_KEY] == "manifest.tensors[0]"
            unknown = await refused(build_manifest(job_id="nope", version=1, mode=ADAPTER_MODE,
                                                   base_model_fingerprint=FINGERPRINT,
                                                   buckets=list(pack(trainer.adapter().items()))))
            assert unknown.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(PublishError, match="ALREADY_EXISTS"):
                await pub.publish("job", 1, adapter=trainer.adapter())

            # The same version with the same content is an idempotent duplicate: no second round.
            trainer.step(1)
            again = await pub.publish("job", 1, adapter=trainer.adapter())
            assert again.duplicate and again.activation.ok
            status = (await pub.status("job")).jobs[0]
            assert (status.latest_version, status.active_version) == (1, 1)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await pub.await_activation("job", 5, 1)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    run(scenario())


def test_auto_mode_with_a_replica_that_cannot_run_lora_is_merged_and_says_why(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (running_service(tmp_path) as (running, _),
                    agent(running.address, "dense", capabilities=caps()),
                    agent(running.address, "moe", capabilities=caps(lora=False, engine="vllm-cpu"), job_ids=["j"]),
                    WeightPublisher(running.address, token=TOKEN) as pub):
            trainer = TinyTrainer()
            reg = await registered(pub, trainer, "j", common_pb2.SYNC_MODE_AUTO)
            assert reg.mode == common_pb2.SYNC_MODE_MERGED
            assert "moe: engine (vllm-cpu) does not support LoRA (supports_lora=false)" in reg.reason
            status = (await pub.status("j")).jobs[0]
            assert status.mode == common_pb2.SYNC_MODE_MERGED and status.mode_reason == reg.reason
            only_dense = await registered(pub, trainer, "k", common_pb2.SYNC_MODE_AUTO)
            assert only_dense.mode == ADAPTER_MODE and "all 1 replicas" in only_dense.reason

    run(scenario())


def test_a_shared_replica_refuses_a_job_that_would_write_its_base(tmp_path: Path) -> None:
    """A replica several jobs share (caps.shared, e.g. the Tinker front's) with no LoRA: a job that would be merged
    into it is refused at registration (FAILED_PRECONDITION naming the replica), never served merged; the fleet
    shows what each replica subscribed with (the trainer's CreateJob reads it to refuse such a job earlier)."""
    async def scenario() -> None:
        shared = caps(lora=False, engine="vllm-cpu")
        shared.shared = True
        async with (running_service(tmp_path) as (running, _), agent(running.address, "moe", capabilities=shared),
                    WeightPublisher(running.address, token=TOKEN) as pub):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await registered(pub, TinyTrainer(), "j", common_pb2.SYNC_MODE_AUTO)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "replica moe: this rollout is shared by several jobs and its engine (vllm-cpu) does not support " \
                   "LoRA" in refused.value.details()
            [replica] = (await pub.status_now()).fleet
            assert replica.capabilities.shared and not replica.capabilities.supports_lora

    run(scenario())


def test_mixed_transports_late_joiner_and_local_merge(tmp_path: Path) -> None:
    """One collective and one inline-only replica in the same round; a late joiner of a MERGED job gets
    the durable adapter inline with serve_mode MERGED (merge locally)."""

    async def scenario() -> None:
        async with running_service(tmp_path) as (running, core), WeightPublisher(
                running.address, token=TOKEN, bucket_bytes=8 << 10) as pub:
            trainer = TinyTrainer()
            await registered(pub, trainer, "m", common_pb2.SYNC_MODE_MERGED)
            async with (agent(running.address, "fast") as (_, fast),
                        agent(running.address, "slow", capabilities=caps(collective=False)) as (_, slow)):
                for version in (1, 2):
                    trainer.step(version)
                    result = await pub.publish("m", version, adapter=trainer.adapter(), merged=trainer.merged)
                    assert result.activation.ok, result.activation.error
                    assert result.transport == "collective" and result.receivers == 1
                    transports = {r.replica_id: r.transport for r in result.activation.replicas}
                    assert transports == {"fast": "collective", "slow": "inline"}
                merged = dict(trainer.merged())
                assert same(fast.active["m"].tensors, merged) and fast.active["m"].manifest.mode == MERGED
                assert same(slow.active["m"].tensors, trainer.adapter()) and slow.active["m"].local_merge
                # Only the adapter is kept on disk, never the merged weights.
                stored = sorted(f.name for f in core.store.version_dir("m", 2).iterdir())
                assert stored == ["adapter.binpb", "adapter.json", "adapter.safetensors", "manifest.binpb",
                                  "manifest.json"]

            async with agent(running.address, "late", capabilities=caps(lora=False)) as (_, late):
                await eventually(lambda: late.active_versions().get("m") == 2, 20, "late joiner at v2")
                update = late.active["m"]
                assert update.local_merge and same(update.tensors, trainer.adapter())
                assert [e[0] for e in late.events] == ["stage", "commit"]  # only the latest, once

            # FetchWeights serves the durable adapter of the active version to anyone.
            fetched = [r async for r in pub.stub.FetchWeights(weightsync_pb2.FetchWeightsRequest(job_id="m"))]
            assert fetched[0].manifest.version == 2 and fetched[0].manifest.mode == ADAPTER_MODE
            assert sum(len(r.chunk.data) for r in fetched[1:]) == fetched[0].manifest.total_bytes
            status = {r.replica_id: r for r in (await pub.status("m")).jobs[0].replicas}
            assert {rid: (s.active_version, s.connected) for rid, s in status.items()} == {
                "fast": (2, False), "slow": (2, False), "late": (2, False)}

    run(scenario())


def test_failed_catch_up_keeps_the_old_version_reports_and_retries(tmp_path: Path) -> None:
    async def scenario() -> None:
        broken = {"on": True}

        def flip(manifest, index, piece):
            if broken["on"]:
                piece[0] ^= 1  # in place: the received bytes themselves are damaged
            return piece

        async with running_service(tmp_path) as (running, _), WeightPublisher(running.address, token=TOKEN) as pub:
            trainer = TinyTrainer()
            await registered(pub, trainer)
            trainer.step(1)
            assert (await pub.publish("job", 1, adapter=trainer.adapter())).activation.ok  # nobody subscribed
            async with agent(running.address, "r", receive_hook=flip) as (_, sink):
                async def errored():
                    replicas = (await pub.status("job")).jobs[0].replicas
                    return replicas and "checksum mismatch" in replicas[0].last_error and replicas[0]

                state = await eventually(errored, 20, "catch-up failure reported")
                assert state.active_version == 0 and sink.active_versions() == {}
                broken["on"] = False
                await eventually(lambda: sink.active_versions().get("job") == 1, 20, "catch-up after the retry")
                state = (await pub.status("job")).jobs[0].replicas[0]
                assert state.active_version == 1 and state.last_error == ""

    run(scenario())


def test_upload_is_verified_and_restart_reloads_everything(tmp_path: Path) -> None:
    async def scenario() -> None:
        trainer = TinyTrainer()
        async with running_service(tmp_path) as (running, _), WeightPublisher(running.address, token=TOKEN) as pub:
            await registered(pub, trainer)
            trainer.step(1)
            assert (await pub.publish("job", 1, adapter=trainer.adapter())).activation.ok
            trainer.step(2)
            pending = await pub.publish("job", 2, adapter=trainer.adapter(), wait=False)
            assert pending.uploaded_bytes == pending.payload_bytes

            manifest = (await pub.stub.GetManifest(weightsync_pb2.GetManifestRequest(job_id="job", version=2))).manifest

            async def bad_upload():
                yield weightsync_pb2.UploadWeightsRequest(job_id="job", version=2)
                yield weightsync_pb2.UploadWeightsRequest(chunk=common_pb2.WeightChunk(bucket=0, offset=8, data=b"x"))

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pub.stub.UploadWeights(bad_upload())
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected 0" in info.value.details()
            assert manifest.version == 2

        # A new server on the same storage: jobs, versions and bytes come back from disk.
        async with running_service(tmp_path) as (running, _), WeightPublisher(running.address, token=TOKEN) as pub:
            status = (await pub.status()).jobs[0]
            assert (status.job_id, status.latest_version, status.active_version) == ("job", 2, 2)
            assert (await registered(pub, trainer)).latest_version == 2
            async with agent(running.address, "after-restart") as (_, sink):
                await eventually(lambda: sink.active_versions().get("job") == 2, 20, "catch-up from disk")
                assert same(sink.active["job"].tensors, trainer.adapter())
            trainer.step(3)
            assert (await pub.publish("job", 3, adapter=trainer.adapter())).activation.ok

    run(scenario())


def test_fleet_lists_advertised_replicas_and_the_pool_follows_it(tmp_path: Path) -> None:
    """Replicas advertise where they serve; weight sync lists them before any job publishes, with their
    versions once one does; a dropped stream leaves the fleet; a bad address is refused naming the field."""
    from lorarl.client.calls import NamedStub
    from lorarl.client.rl.fleet import weightsync_fleet
    from lorarl.common.channel import aio_channel
    from lorarl.v1 import weightsync_pb2_grpc

    async def scenario() -> None:
        async with running_service(tmp_path / "ws") as (running, _), \
                aio_channel(running.address, token=TOKEN) as channel:
                stub = NamedStub(weightsync_pb2_grpc.WeightSyncServiceStub(channel), "weightsync", running.address)
                discover = weightsync_fleet(stub, "job")
                async with agent(running.address, "r-a", serve_address="127.0.0.1:7001"), \
                        agent(running.address, "r-b", serve_address="[::1]:7002"), agent(running.address, "r-quiet"):
                    fleet = await discover()
                    assert fleet.active_version == 0  # no job yet: every replica at 0
                    assert [(r.replica_id, r.address) for r in fleet.replicas] == [("r-a", "127.0.0.1:7001"),
                                                                                    ("r-b", "[::1]:7002")]
                    async with agent(running.address, "r-gone", serve_address="127.0.0.1:7003"):
                        assert len((await discover()).replicas) == 3
                    await eventually(lambda: _count(discover, 2), 10, "r-gone dropped")
                bad = weightsync_pb2.SubscribeRequest(replica_id="r-bad", serve_address="no-port")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in weightsync_pb2_grpc.WeightSyncServiceStub(channel).Subscribe(
                            bad, metadata=(("authorization", f"Bearer {TOKEN}"),)):
                        pass
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "serve_address" in refused.value.details()

    run(scenario())


async def _count(discover, n: int) -> bool:
    fleet = await discover()
    return fleet is not None and len(fleet.replicas) == n


class WorkersSink(InMemorySink):
    """A replica whose engine receives in its own workers, one rank each (as a tensor-parallel vLLM engine
    with rollout.receive_in_worker does): every 'worker' is a thread joining the real gloo group with the
    rank it was given, verifying what it got; versions it merges itself pass through the agent."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.received: list[tuple[list[int], list[dict[str, torch.Tensor]]]] = []

    def receive_in_engine(self, manifest, rendezvous, key, serve_mode):
        import threading

        from lorarl.contract.transfer_ranks import merges_locally
        from lorarl.weightsync.client.agent import verify_pieces
        from lorarl.weightsync.wire.collective import WeightTransferGroup

        if merges_locally(manifest.mode, serve_mode):
            return None
        ranks = list(rendezvous["ranks"])
        assert len(ranks) == self.workers
        got: list[dict[str, torch.Tensor] | None] = [None] * len(ranks)

        def worker(index: int) -> None:
            group = WeightTransferGroup(rendezvous["backend"], rendezvous["master_address"],
                                        rendezvous["master_port"], ranks[index], rendezvous["world_size"],
                                        rendezvous["group_name"], timeout_s=30, local_address="127.0.0.1")
            try:
                pieces = group.receive_pieces([b.nbytes for b in manifest.buckets], rendezvous["source_rank"])
                got[index] = {n: t.clone() for n, t in verify_pieces(manifest, pieces, key=key).items()}
            finally:
                group.close(wait=False)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(ranks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(g is not None for g in got)
        self.received.append((ranks, got))  # type: ignore[arg-type]
        return got[0]


def test_a_replica_receiving_in_its_workers_gets_one_rank_per_worker(tmp_path: Path) -> None:
    """Two replicas in one round, one of them with two receiving workers: ranks 1-2 go to its workers,
    rank 3 to the other replica (or the other way round), the group's world is 4; every worker verifies
    the full version."""
    async def scenario() -> None:
        async with running_service(tmp_path) as (running, _), WeightPublisher(
                running.address, token=TOKEN, bucket_bytes=8 << 10) as pub:
            trainer = TinyTrainer()
            await registered(pub, trainer, "tp")
            two = WorkersSink(2)
            two_caps = caps()
            two_caps.receiving_ranks = 2
            async with (agent(running.address, "tp2", sink=two, capabilities=two_caps),
                        agent(running.address, "tp1") as (_, one)):
                trainer.step(1)
                result = await pub.publish("tp", 1, adapter=trainer.adapter(), merged=trainer.merged)
                assert result.activation.ok, result.activation.error
                assert result.receivers == 3  # world 4: the sender and three receiving processes
                [(ranks, got)] = two.received
                assert ranks == [1, 2] or ranks == [2, 3]
                assert all(same(g, trainer.adapter()) for g in got)
                assert same(two.active["tp"].tensors, trainer.adapter())
                assert same(one.active["tp"].tensors, trainer.adapter())

    run(scenario())


@pytest.mark.parametrize("sender", ["dead", "silent"])
def test_a_version_whose_sender_is_gone_does_not_hold_up_the_next_one(tmp_path: Path, sender: str) -> None:
    """The trainer dies after weight sync accepted v2's manifest and before it sends (#29: a SIGKILL during
    PublishWeights). 'dead': its rendezvous port refuses connections, and the replica fails v2 at once,
    saying so. 'silent': the store still answers but no sender comes (a hung publisher), so the replica
    waits in the rendezvous; the restarted trainer's v3 supersedes v2 (FAILED, naming why) and the replica
    takes v3 in a receive of its own instead of after the stuck one's collective timeout. Either way v3
    activates in seconds (before: it stayed PENDING behind v2 for the whole collective timeout)."""
    import socket
    import time as clock

    from lorarl.weightsync.wire.collective import rendezvous_store
    from lorarl.weightsync.wire.payload import transfer_key

    async def scenario() -> None:
        async with running_service(tmp_path, collective_timeout_s=60) as (running, _), \
                agent(running.address, "r0") as (_, sink):
            trainer = TinyTrainer()
            store = None
            async with WeightPublisher(running.address, token=TOKEN, bucket_bytes=8 << 10) as first:
                await registered(first, trainer)
                trainer.step(1)
                assert (await first.publish("job", 1, adapter=trainer.adapter())).activation.ok
                if sender == "dead":
                    with socket.socket() as s:  # a rendezvous port nothing listens on: the dead trainer's
                        s.bind(("127.0.0.1", 0))
                        port = s.getsockname()[1]
                else:
                    store = rendezvous_store("127.0.0.1", 60)
                    port = store.port
                trainer.step(2)
                buckets = list(pack(sorted(trainer.adapter().items()), bucket_bytes=8 << 10))
                manifest = build_manifest(job_id="job", version=2, mode=ADAPTER_MODE, buckets=buckets,
                                          base_model_fingerprint=FINGERPRINT, lora=lora_spec(),
                                          key=transfer_key(TOKEN, "job"))
                await first.stub.PublishManifest(weightsync_pb2.PublishManifestRequest(
                    manifest=manifest, sender_host="127.0.0.1", sender_port=port), timeout=30)
                if sender == "dead":
                    v2 = await first.await_activation("job", 2, timeout_s=15)
                    assert not v2.ok and "does not answer" in v2.error and "publisher is gone" in v2.error, v2
                else:
                    await asyncio.sleep(1.0)  # the replica now waits in v2's rendezvous for rank 0
            async with WeightPublisher(running.address, token=TOKEN, bucket_bytes=8 << 10) as restarted:
                await registered(restarted, trainer)
                trainer.step(3)
                started = clock.monotonic()
                result = await restarted.publish("job", 3, adapter=trainer.adapter(), timeout_s=50)
                assert result.activation.ok, result.activation.error
                assert clock.monotonic() - started < 20
                assert same(sink.active["job"].tensors, trainer.adapter())
                if sender == "silent":
                    stuck = await restarted.await_activation("job", 2, timeout_s=5)
                    assert not stuck.ok and "superseded by v3" in stuck.error, stuck
            del store

    run(scenario())
