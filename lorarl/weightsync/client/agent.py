"""The rollout side of weight sync: subscribe, receive and verify versions, hand them to a PolicySink.

One agent per replica. It subscribes with the replica's capabilities and the versions it already
serves, then follows the service's events: Stage (receive the bytes over the collective
group or inline, verify every bucket and tensor checksum and every bucket's keyed hash under the job's
transfer key (derived from the token), give the tensors to `sink.stage`, report
staged ok or the error), Commit (`sink.commit`, report active), Abort (`sink.abort`). A stage runs
beside the stream, so an Abort or a newer Stage of the job is acted on while a receive is stuck (its
sender died); only a job's latest stage reaches the sink, and a commit waits for its stage. When the
stream drops (service restart, network), it resubscribes with backoff; the service then catches it
up if it fell behind. Transport and sink work run in worker threads, so the event loop stays live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import torch

from lorarl.common.channel import ClientTls, aio_channel
from lorarl.contract.transfer_ranks import held_ranks
from lorarl.platform.shared_memory import SegmentError, read_buffers
from lorarl.v1 import common_pb2, weightsync_pb2, weightsync_pb2_grpc
from lorarl.weightsync.client.sinks import PolicySink, PolicyUpdate
from lorarl.weightsync.wire.collective import BACKEND_NAMES, WeightTransferGroup
from lorarl.weightsync.wire.inline import BucketAssembler
from lorarl.weightsync.wire.net import listening, local_address_towards
from lorarl.weightsync.wire.payload import PayloadVerifier, manifest_digest, transfer_key, validate_manifest

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Fault injection: sees each received piece (a view into its bucket) before it is verified; may change
#: bytes in place, and returns the piece, or a prefix of it to simulate a transfer cut short.
ReceiveHook = Callable[[common_pb2.WeightManifest, int, torch.Tensor], torch.Tensor]
Piece = tuple[int, torch.Tensor, int, int]  # bucket index, bucket buffer, start, end


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a daemon thread of its own. For collective receives: one whose sender died blocks
    in the group's rendezvous until the collective timeout, and cannot be interrupted; a daemon thread
    neither holds up the agent (its result is dropped) nor the process's exit (asyncio.to_thread's
    executor would wait for it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            with contextlib.suppress(RuntimeError):  # the loop may be closed by now
                loop.call_soon_threadsafe(settle, None, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, name=f"weightsync-receive-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


class StageError(Exception):
    """A version cannot be staged on this replica (reported to the service as staged ok=false)."""


def verify_pieces(manifest: common_pb2.WeightManifest, pieces: Iterable[Piece],
                  hook: ReceiveHook | None = None, key: bytes | None = None) -> dict[str, torch.Tensor]:
    """Checks every bucket and tensor checksum (and with ``key`` every bucket's MAC) as pieces land, and
    that nothing is missing; returns tensor views by name. Consumes every piece even after a failure,
    so a collective transfer completes for the peers."""
    verifier = PayloadVerifier(manifest, key)
    for index, buffer, start, end in pieces:
        short = False
        if hook is not None and verifier.error is None:
            passed = hook(manifest, index, buffer[start:end]).numel()
            short, end = passed < end - start, start + passed
        verifier.feed(index, buffer, start, end, short=short)
    return verifier.finish()


def verified_tensors(manifest: common_pb2.WeightManifest, buffers: Iterable[torch.Tensor],
                     hook: ReceiveHook | None = None, key: bytes | None = None) -> dict[str, torch.Tensor]:
    """verify_pieces over whole buckets (inline transfers)."""
    return verify_pieces(manifest, ((i, b, 0, b.numel()) for i, b in enumerate(buffers)), hook, key)


class WeightSyncAgent:
    """Keeps a PolicySink in sync with the weight-sync service (see module docstring).

    host: the address this replica's collective endpoint is reachable at (default: the local address
    of the route to the service). capabilities.collective_backends empty: inline transfers only.
    serve_address: where clients reach the replica's RolloutService, advertised so the RL loop finds it.
    """

    def __init__(self, target: str, sink: PolicySink, *, replica_id: str,
                 capabilities: weightsync_pb2.ReplicaCapabilities, job_ids: Sequence[str] = (),
                 host: str | None = None, token: str | None = None, tls: ClientTls | None = None,
                 device: str = "cpu", reconnect_min_s: float = 0.2, reconnect_max_s: float = 5.0,
                 receive_hook: ReceiveHook | None = None, serve_address: str = "") -> None:
        self.target, self.sink, self.replica_id = target, sink, replica_id
        self.capabilities, self.job_ids = capabilities, list(job_ids)
        self.host = host or local_address_towards(target)
        self.token, self.tls, self.device = token, tls, device
        self.reconnect_min_s, self.reconnect_max_s = reconnect_min_s, reconnect_max_s
        self.receive_hook, self.serve_address = receive_hook, serve_address
        self.colocation_id = capabilities.colocation_id  # the shared base this replica computes on, if any
        self.staged: dict[str, int] = {}
        self.timings: dict[tuple[str, int], dict[str, float]] = {}
        self.subscriptions = 0
        self._stub: weightsync_pb2_grpc.WeightSyncServiceStub | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._stopping = False
        self._connected = threading.Event()
        #: per job, the stage in flight: (version, task). Stages run beside the event stream, so an Abort or
        #: a newer Stage is read while a receive is stuck (a sender that died leaves it waiting for the
        #: collective timeout); only the job's latest stage may reach the sink.
        self._stages: dict[str, tuple[int, asyncio.Task[None]]] = {}
        self._sink_lock = asyncio.Lock()  # the sink sees one call at a time (PolicySink's contract)

    # ------------------------------------------------------------------------------ lifecycle

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        """Blocks until subscribed (any thread)."""
        return self._connected.wait(timeout)

    def stop(self) -> None:
        """Ends run() after the current event (call on the agent's loop)."""
        self._stopping = True
        if self._call is not None:
            self._call.cancel()

    async def run(self) -> None:
        """Subscribes and follows events until stop(); reconnects with backoff when the stream drops."""
        delay = self.reconnect_min_s
        async with aio_channel(self.target, token=self.token, tls=self.tls) as channel:
            self._stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
            while not self._stopping:
                try:
                    if await self._session():
                        delay = self.reconnect_min_s
                except grpc.aio.AioRpcError as exc:
                    if not self._stopping:
                        logger.warning("weight-sync stream lost (%s): %s; retrying in %.1f s", exc.code().name,
                                       exc.details(), delay, extra={"replica_id": self.replica_id})
                except asyncio.CancelledError:
                    if not self._stopping:
                        raise
                except Exception:  # a sink or local failure must not end the agent: resubscribe
                    logger.exception("weight-sync agent %s failed; resubscribing in %.1f s", self.replica_id, delay)
                finally:
                    self._connected.clear()
                    self._call = None
                if not self._stopping:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.reconnect_max_s)

    async def _session(self) -> bool:
        """One subscription; True if it was established before it ended."""
        assert self._stub is not None
        active = await asyncio.to_thread(self.sink.active_versions)
        request = weightsync_pb2.SubscribeRequest(replica_id=self.replica_id, job_ids=self.job_ids,
                                                  capabilities=self.capabilities, host=self.host,
                                                  active_versions=active, serve_address=self.serve_address)
        call = self._stub.Subscribe(request)
        self._call = call
        await call.wait_for_connection()
        self.subscriptions += 1
        self._connected.set()
        logger.info("subscribed to weight sync at %s as %s (active %s)", self.target, self.replica_id, active,
                    extra={"replica_id": self.replica_id})
        try:
            async for event in call:
                await self._handle(event)
        finally:
            for _, task in self._stages.values():
                task.cancel()  # a receive thread still running ends at its own timeout; its result is dropped
            self._stages.clear()
        return True

    async def _handle(self, event: weightsync_pb2.SubscribeResponse) -> None:
        kind = event.WhichOneof("event")
        if kind == "stage":
            manifest = event.stage.manifest
            previous = self._stages.get(manifest.job_id)
            if previous is not None and not previous[1].done():
                logger.warning("%s v%d arrives while v%d is still being received; v%d is dropped", manifest.job_id,
                               manifest.version, previous[0], previous[0], extra={"replica_id": self.replica_id})
            self._stages[manifest.job_id] = (manifest.version, asyncio.create_task(self._stage(event.stage)))
        elif kind == "commit":
            await self._settle_stage(event.commit.job_id, event.commit.version)
            await self._commit(event.commit.job_id, event.commit.version)
        elif kind == "abort":
            await self._abort(event.abort)

    async def _settle_stage(self, job_id: str, version: int) -> None:
        """Waits for the job's stage of ``version`` to finish (the service commits only what was staged)."""
        if self._current(job_id, version):
            await asyncio.shield(self._stages[job_id][1])

    def _current(self, job_id: str, version: int) -> bool:
        """Whether ``version`` is still the job's latest stage (not superseded by a newer one, not aborted)."""
        current = self._stages.get(job_id)
        return current is not None and current[0] == version

    # --------------------------------------------------------------------------------- stage

    async def _stage(self, stage: weightsync_pb2.StageEvent) -> None:
        manifest = stage.manifest
        job_id, version = manifest.job_id, manifest.version
        started = time.perf_counter()
        try:
            active = (await asyncio.to_thread(self.sink.active_versions)).get(job_id, 0)
            if version <= active:
                raise StageError(f"v{version} is not newer than the active v{active}")
            validate_manifest(manifest)
            transport = manifest.transport.WhichOneof("kind")
            if transport == "collective":
                c = manifest.transport.collective
                refused = await asyncio.to_thread(listening, c.master_address, c.master_port)
                if refused:  # the sender (its store) is gone: fail now, not at the collective timeout
                    raise StageError(f"the sender's rendezvous at {c.master_address}:{c.master_port} does not answer "
                                     f"({refused}): its publisher is gone")
                tensors = await in_daemon_thread(self._receive_in_engine, stage)
                if tensors is None:
                    if stage.rank_count > 1:  # its other ranks would never join: the sender times out
                        raise StageError(f"weight sync assigned {stage.rank_count} ranks (one per engine worker) "
                                         "but the engine did not receive this version in its workers")
                    tensors = await in_daemon_thread(self._receive_collective, stage)
            elif transport == "inline":
                tensors = await self._receive_inline(manifest)
            elif transport == "shared_memory":
                tensors = await asyncio.to_thread(self._receive_shared_memory, manifest)
            else:
                raise StageError(f"transport {transport!r} is not supported by this agent")
            received = time.perf_counter()
            update = PolicyUpdate(manifest, tensors, stage.serve_mode or manifest.mode)
            async with self._sink_lock:
                if not self._current(job_id, version):
                    raise StageError(f"v{version} was superseded or aborted while it was received")
                await asyncio.to_thread(self.sink.stage, update)
                self.staged[job_id] = version
            self.timings[(job_id, version)] = {"receive_s": received - started,
                                               "stage_s": time.perf_counter() - started}
            ok, error = True, ""
        except Exception as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
            logger.warning("rejected %s v%d: %s", job_id, version, error, extra={"replica_id": self.replica_id})
        await self._report(self._stub_call("ReportStaged", weightsync_pb2.ReportStagedRequest(
            replica_id=self.replica_id, job_id=job_id, version=version, ok=ok, error=error)))

    def _receive_in_engine(self, stage: weightsync_pb2.StageEvent) -> Mapping[str, torch.Tensor] | None:
        """Where the sink's engine receives transfers in its own worker (the rollout's vLLM worker, into
        device memory), it gets the rendezvous and the key and does the receive and every check itself;
        this agent keeps the control plane; ``ranks`` holds one rank per worker that joins (see
        contract/transfer_ranks.py). None: receive here (also under a fault-injection hook)."""
        receive = getattr(self.sink, "receive_in_engine", None)
        if receive is None or self.receive_hook is not None:
            return None
        manifest = stage.manifest
        c = manifest.transport.collective
        backend = BACKEND_NAMES.get(c.backend)
        if backend is None:
            raise StageError(f"unknown collective backend {c.backend}")
        rendezvous = {"backend": backend, "master_address": c.master_address, "master_port": c.master_port,
                      "ranks": held_ranks(stage.rank, stage.rank_count), "world_size": c.world_size,
                      "group_name": c.group_name,
                      "source_rank": c.source_rank, "timeout_s": float(c.timeout_seconds or 120),
                      "local_address": self.host}
        return receive(manifest, rendezvous, transfer_key(self.token, manifest.job_id),
                       stage.serve_mode or manifest.mode)

    def _receive_collective(self, stage: weightsync_pb2.StageEvent) -> dict[str, torch.Tensor]:
        manifest = stage.manifest
        c = manifest.transport.collective
        backend = BACKEND_NAMES.get(c.backend)
        if backend is None:
            raise StageError(f"unknown collective backend {c.backend}")
        group = WeightTransferGroup(backend, c.master_address, c.master_port, stage.rank, c.world_size, c.group_name,
                                    timeout_s=c.timeout_seconds or 120, device=self.device, local_address=self.host)
        try:
            pieces = group.receive_pieces([b.nbytes for b in manifest.buckets], src=c.source_rank)
            return verify_pieces(manifest, pieces, self.receive_hook, transfer_key(self.token, manifest.job_id))
        finally:
            group.close(wait=False)

    def _receive_shared_memory(self, manifest: common_pb2.WeightManifest) -> dict[str, torch.Tensor]:
        """The co-located trainer's memory file, mapped (lorarl.platform.shared_memory.read_buffers) and checked
        like any transfer; only a replica computing on the same shared base is sent one."""
        handle = manifest.transport.shared_memory
        if not self.colocation_id or handle.colocation_id != self.colocation_id:
            raise StageError(f"a shared-memory handoff for shared base {handle.colocation_id!r} reached a replica "
                             f"on {self.colocation_id or 'a base of its own'!r}")
        try:
            buffers = read_buffers(handle.pid, handle.fd, [b.nbytes for b in manifest.buckets])
        except SegmentError as e:
            raise StageError(str(e)) from None
        return verified_tensors(manifest, buffers, self.receive_hook, transfer_key(self.token, manifest.job_id))

    async def _receive_inline(self, manifest: common_pb2.WeightManifest) -> dict[str, torch.Tensor]:
        assert self._stub is not None
        request = weightsync_pb2.FetchWeightsRequest(job_id=manifest.job_id, version=manifest.version,
                                                     chunk_bytes=manifest.transport.inline.chunk_bytes)
        assembler: BucketAssembler | None = None
        async for response in self._stub.FetchWeights(request):
            if assembler is None:
                if not response.HasField("manifest") or manifest_digest(response.manifest) != manifest_digest(manifest):
                    raise StageError("FetchWeights answered with a different manifest")
                assembler = BucketAssembler(manifest)
            else:
                assembler.add(response.chunk)
        if assembler is None:
            raise StageError("FetchWeights returned nothing")
        buffers = assembler.finish()
        return await asyncio.to_thread(verified_tensors, manifest, buffers, self.receive_hook,
                                       transfer_key(self.token, manifest.job_id))

    # ------------------------------------------------------------------------ commit / abort

    async def _commit(self, job_id: str, version: int) -> None:
        if self.staged.get(job_id) != version:
            logger.warning("commit of %s v%d, which is not staged here; ignored", job_id, version)
            return
        try:
            async with self._sink_lock:
                await asyncio.to_thread(self.sink.commit, job_id, version)
        except Exception as exc:
            logger.exception("sink failed to commit %s v%d", job_id, version)
            await self._report(self._stub_call("ReportStaged", weightsync_pb2.ReportStagedRequest(
                replica_id=self.replica_id, job_id=job_id, version=version, ok=False,
                error=f"commit failed: {type(exc).__name__}: {exc}")))
            return
        finally:
            self.staged.pop(job_id, None)
        await self._report(self._stub_call("ReportActive", weightsync_pb2.ReportActiveRequest(
            replica_id=self.replica_id, job_id=job_id, version=version)))

    async def _abort(self, abort: weightsync_pb2.AbortEvent) -> None:
        logger.info("abort %s v%d: %s", abort.job_id, abort.version, abort.reason)
        if self._current(abort.job_id, abort.version):  # a receive in flight: its result is dropped
            self._stages.pop(abort.job_id)
        async with self._sink_lock:
            if self.staged.get(abort.job_id) == abort.version:
                self.staged.pop(abort.job_id)
                try:
                    await asyncio.to_thread(self.sink.abort, abort.job_id, abort.version)
                except Exception:
                    logger.exception("sink failed to abort %s v%d", abort.job_id, abort.version)

    def _stub_call(self, method: str, request: object) -> asyncio.Future[object]:
        assert self._stub is not None
        return getattr(self._stub, method)(request, timeout=30)

    async def _report(self, call: asyncio.Future[object]) -> None:
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            logger.warning("report to weight sync failed (%s): %s", exc.code().name, exc.details())


class AgentThread:
    """Runs a WeightSyncAgent on its own event loop in a daemon thread, for engines that are not asyncio."""

    def __init__(self, agent: WeightSyncAgent) -> None:
        self.agent = agent
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=f"weightsync-agent-{agent.replica_id}", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self.agent.run())
        self._loop.close()

    def start(self, wait_connected_s: float | None = None) -> AgentThread:
        self._thread.start()
        if wait_connected_s is not None and not self.agent.wait_connected(wait_connected_s):
            raise TimeoutError(f"agent did not subscribe within {wait_connected_s} s")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.agent.stop)
            self._thread.join(timeout)
