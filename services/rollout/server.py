"""RolloutService over gRPC: a thin servicer plugged into the shared bootstrap.

Servicer methods translate protobuf messages into calls on plain Python objects and back; the
bootstrap turns exceptions from services.common.errors into statuses. RPCs not overridden here
answer UNIMPLEMENTED (the generated base class). Heavy libraries (torch, vllm) must be
imported lazily by the code that needs them, so `lorarl serve rollout` starts fast.
"""

from __future__ import annotations

import grpc
from lorarl.v1 import rollout_pb2, rollout_pb2_grpc

from services.common.server import Register, serve
from services.rollout.config import RolloutServiceConfig, RolloutSettings

NAME = "rollout"
SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
CONFIG_TYPE = RolloutServiceConfig


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """RolloutService RPCs; each will delegate to the rollout engine once implemented."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings


def registration(servicer: RolloutServicer) -> Register:
    """Adds `servicer` to a server; returns the service names for health and reflection."""

    def register(server: grpc.aio.Server) -> list[str]:
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return register


async def serve_forever(config: RolloutServiceConfig) -> None:
    """Runs the rollout service until SIGTERM/SIGINT."""
    servicer = RolloutServicer(config.rollout)
    await serve(NAME, config.server, registration(servicer))
