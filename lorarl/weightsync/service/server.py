"""WeightSyncService over gRPC: a thin servicer plugged into the shared bootstrap.

Servicer methods translate protobuf messages into calls on WeightSyncCore and back (convert.py); the
bootstrap turns exceptions from lorarl.common.errors into statuses. Heavy libraries (torch)
are imported by the modules that need them when the servicer is built, not by `lorarl --help`.
Version 0 in FetchWeights and GetManifest means the active version (what a late joiner gets).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from lorarl.common.errors import InvalidArgumentError
from lorarl.common.server import Register, RunningServer, serve, start_server
from lorarl.v1 import common_pb2, weightsync_pb2, weightsync_pb2_grpc
from lorarl.weightsync.service import convert
from lorarl.weightsync.service.config import WeightSyncServiceConfig, WeightSyncSettings

if TYPE_CHECKING:
    from lorarl.weightsync.service.core import WeightSyncCore

NAME = "weightsync"
SERVICE_NAME = weightsync_pb2.DESCRIPTOR.services_by_name["WeightSyncService"].full_name
CONFIG_TYPE = WeightSyncServiceConfig

Context = grpc.aio.ServicerContext


class WeightSyncServicer(weightsync_pb2_grpc.WeightSyncServiceServicer):
    """WeightSyncService RPCs, each delegating to one WeightSyncCore method."""

    def __init__(self, settings: WeightSyncSettings, core: WeightSyncCore | None = None) -> None:
        from lorarl.weightsync.service.core import WeightSyncCore

        self.settings = settings
        self.core = core if core is not None else WeightSyncCore(settings)

    async def RegisterJob(self, request: weightsync_pb2.RegisterJobRequest, context: Context
                          ) -> weightsync_pb2.RegisterJobResponse:
        return convert.registered(self.core.register_job(request))

    async def PublishManifest(self, request: weightsync_pb2.PublishManifestRequest, context: Context
                              ) -> weightsync_pb2.PublishManifestResponse:
        adapter = request.adapter if request.HasField("adapter") else None
        shared_memory = request.shared_memory if request.HasField("shared_memory") else None
        if shared_memory is not None and not (shared_memory.colocation_id and shared_memory.pid
                                              and shared_memory.fd):
            raise InvalidArgumentError("shared_memory", "names no memory file: colocation_id, pid and fd are all "
                                       "required (or leave shared_memory out)")
        return convert.published(self.core.publish(request.manifest, adapter, request.sender_host,
                                                   request.sender_port, shared_memory))

    async def UploadWeights(self, request_iterator: AsyncIterator[weightsync_pb2.UploadWeightsRequest],
                            context: Context) -> weightsync_pb2.UploadWeightsResponse:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "job_id":
            raise InvalidArgumentError("job_id", "the first UploadWeights message must name the job")

        async def chunks() -> AsyncIterator[common_pb2.WeightChunk]:
            async for request in request_iterator:
                if request.WhichOneof("payload") != "chunk":
                    raise InvalidArgumentError("chunk", "only chunks may follow the first message")
                yield request.chunk

        received = await self.core.upload(first.job_id, first.version, chunks())
        return weightsync_pb2.UploadWeightsResponse(bytes_received=received)

    async def Subscribe(self, request: weightsync_pb2.SubscribeRequest, context: Context
                        ) -> AsyncIterator[weightsync_pb2.SubscribeResponse]:
        replica = self.core.subscribe(request)
        session, outbox = replica.session, replica.outbox
        assert outbox is not None
        try:
            await context.send_initial_metadata(())  # lets the agent know it is subscribed
            while (event := await outbox.get()) is not None:  # None: replaced by a newer stream, or shutdown
                yield event
        finally:
            self.core.unsubscribe(replica.replica_id, session)

    async def ReportStaged(self, request: weightsync_pb2.ReportStagedRequest, context: Context
                           ) -> weightsync_pb2.ReportStagedResponse:
        self.core.report_staged(request.replica_id, request.job_id, request.version, request.ok, request.error)
        return weightsync_pb2.ReportStagedResponse()

    async def ReportActive(self, request: weightsync_pb2.ReportActiveRequest, context: Context
                           ) -> weightsync_pb2.ReportActiveResponse:
        self.core.report_active(request.replica_id, request.job_id, request.version)
        return weightsync_pb2.ReportActiveResponse()

    async def FetchWeights(self, request: weightsync_pb2.FetchWeightsRequest, context: Context
                           ) -> AsyncIterator[weightsync_pb2.FetchWeightsResponse]:
        async for part in self.core.fetch(request.job_id, request.version, request.chunk_bytes):
            if isinstance(part, common_pb2.WeightManifest):
                yield weightsync_pb2.FetchWeightsResponse(manifest=part)
            else:
                yield weightsync_pb2.FetchWeightsResponse(chunk=part)

    async def GetManifest(self, request: weightsync_pb2.GetManifestRequest, context: Context
                          ) -> weightsync_pb2.GetManifestResponse:
        return weightsync_pb2.GetManifestResponse(manifest=self.core.get_manifest(request.job_id, request.version))

    async def GetSyncStatus(self, request: weightsync_pb2.GetSyncStatusRequest, context: Context
                            ) -> weightsync_pb2.GetSyncStatusResponse:
        return convert.sync_status(self.core.status(request.job_id), self.core.fleet())

    async def AwaitActivation(self, request: weightsync_pb2.AwaitActivationRequest, context: Context
                              ) -> weightsync_pb2.AwaitActivationResponse:
        return convert.activation(await self.core.await_activation(request.job_id, request.version,
                                                                   request.timeout_seconds))


def registration(servicer: WeightSyncServicer) -> Register:
    """Adds `servicer` to a server; returns the service names for health and reflection."""

    def register(server: grpc.aio.Server) -> list[str]:
        weightsync_pb2_grpc.add_WeightSyncServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return register


async def start_weightsync(config: WeightSyncServiceConfig) -> tuple[RunningServer, WeightSyncServicer]:
    """Starts the service in this event loop (tests, benchmarks); stop it with `running.stop()`."""
    servicer = WeightSyncServicer(config.weightsync)
    await servicer.core.start()
    running = await start_server(NAME, config.server, registration(servicer), on_shutdown=servicer.core.close)
    return running, servicer


async def serve_forever(config: WeightSyncServiceConfig) -> None:
    """Runs the weight-sync service until SIGTERM/SIGINT."""
    servicer = WeightSyncServicer(config.weightsync)
    await servicer.core.start()
    await serve(NAME, config.server, registration(servicer), on_shutdown=servicer.core.close)
