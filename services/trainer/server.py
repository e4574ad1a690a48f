"""TrainerService over gRPC: a thin servicer plugged into the shared bootstrap.

Servicer methods translate protobuf messages into calls on plain Python objects and back; the
bootstrap turns exceptions from services.common.errors into statuses. RPCs not overridden here
answer UNIMPLEMENTED (the generated base class). Heavy libraries (torch, transformers) must be
imported lazily by the code that needs them, so `lorarl serve trainer` starts fast.
"""

from __future__ import annotations

import grpc
from lorarl.v1 import trainer_pb2, trainer_pb2_grpc

from services.common.server import Register, serve
from services.trainer.config import TrainerServiceConfig, TrainerSettings

NAME = "trainer"
SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
CONFIG_TYPE = TrainerServiceConfig


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """TrainerService RPCs; each will delegate to the trainer once implemented."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings


def registration(servicer: TrainerServicer) -> Register:
    """Adds `servicer` to a server; returns the service names for health and reflection."""

    def register(server: grpc.aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return register


async def serve_forever(config: TrainerServiceConfig) -> None:
    """Runs the trainer service until SIGTERM/SIGINT."""
    servicer = TrainerServicer(config.trainer)
    await serve(NAME, config.server, registration(servicer))
