"""WeightSyncService over gRPC: a thin servicer plugged into the shared bootstrap.

Servicer methods translate protobuf messages into calls on plain Python objects and back; the
bootstrap turns exceptions from services.common.errors into statuses. RPCs not overridden here
answer UNIMPLEMENTED (the generated base class). Heavy libraries (torch) must be
imported lazily by the code that needs them, so `lorarl serve weightsync` starts fast.
"""

from __future__ import annotations

import grpc
from lorarl.v1 import weightsync_pb2, weightsync_pb2_grpc

from services.common.server import Register, serve
from services.weightsync.config import WeightSyncServiceConfig, WeightSyncSettings

NAME = "weightsync"
SERVICE_NAME = weightsync_pb2.DESCRIPTOR.services_by_name["WeightSyncService"].full_name
CONFIG_TYPE = WeightSyncServiceConfig


class WeightSyncServicer(weightsync_pb2_grpc.WeightSyncServiceServicer):
    """WeightSyncService RPCs; each will delegate to the version registry once implemented."""

    def __init__(self, settings: WeightSyncSettings) -> None:
        self.settings = settings


def registration(servicer: WeightSyncServicer) -> Register:
    """Adds `servicer` to a server; returns the service names for health and reflection."""

    def register(server: grpc.aio.Server) -> list[str]:
        weightsync_pb2_grpc.add_WeightSyncServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return register


async def serve_forever(config: WeightSyncServiceConfig) -> None:
    """Runs the weight-sync service until SIGTERM/SIGINT."""
    servicer = WeightSyncServicer(config.weightsync)
    await serve(NAME, config.server, registration(servicer))
