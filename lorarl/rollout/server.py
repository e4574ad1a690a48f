"""RolloutService over gRPC: a thin servicer plugged into the shared bootstrap.

Servicer methods translate protobuf messages into calls on the RolloutCore (lorarl/rollout/core.py)
and back; the bootstrap turns exceptions from lorarl.common.errors into statuses. Heavy libraries
(torch, vllm) are imported by the engine when it starts, so `lorarl serve rollout` parses its
config fast. Without rollout.model_path the service runs without an engine and answers
FAILED_PRECONDITION.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator

import grpc

from lorarl.common.channel import peer_tls
from lorarl.common.errors import FailedPreconditionError
from lorarl.common.server import Register, RunningServer, serve, start_server
from lorarl.rollout import convert, validation
from lorarl.rollout.config import RolloutServiceConfig, RolloutSettings
from lorarl.rollout.core import RolloutCore
from lorarl.rollout.loading import receive
from lorarl.v1 import rollout_pb2, rollout_pb2_grpc

NAME = "rollout"
SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
CONFIG_TYPE = RolloutServiceConfig


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """RolloutService RPCs, each delegating to the core."""

    def __init__(self, settings: RolloutSettings, core: RolloutCore | None) -> None:
        self.settings = settings
        self._core = core
        self.replica_id = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}"

    @property
    def core(self) -> RolloutCore:
        if self._core is None:
            raise FailedPreconditionError("no engine: rollout.model_path is not set on this replica")
        return self._core

    def _limits(self) -> validation.Limits:
        return validation.Limits.of(self.core.info, self.settings)

    async def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> rollout_pb2.GenerateResponse:
        request_input = validation.generate_input(request, self._limits(), self.core.renderer)
        results, teacher_seconds = await self.core.generate_scored(request_input)
        return rollout_pb2.GenerateResponse(teacher_seconds=teacher_seconds, results=[
            rollout_pb2.PromptCompletions(
                prompt_token_ids=r.prompt_token_ids, prompt_logprobs=r.prompt_logprobs or [],
                prompt_top_logprobs=convert.top_logprobs(r.prompt_top_logprobs),
                completions=[convert.completion(c, len(r.prompt_token_ids)) for c in r.completions])
            for r in results])

    async def GenerateStream(self, request: rollout_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[rollout_pb2.GenerateStreamResponse]:
        request_input = validation.stream_input(request, self._limits(), self.core.renderer)
        async for chunk in self.core.generate_stream(request_input):
            yield convert.stream_chunk(chunk)

    async def GetCapabilities(self, request: rollout_pb2.GetCapabilitiesRequest, context: grpc.aio.ServicerContext
                              ) -> rollout_pb2.GetCapabilitiesResponse:
        return convert.capabilities(self.core.info, self.settings, self.core.fingerprint)

    async def GetReplicaStatus(self, request: rollout_pb2.GetReplicaStatusRequest, context: grpc.aio.ServicerContext
                               ) -> rollout_pb2.GetReplicaStatusResponse:
        return convert.replica_status(self.core.status(), self.replica_id)

    async def LoadWeights(self, request_iterator: AsyncIterator[rollout_pb2.LoadWeightsRequest],
                          context: grpc.aio.ServicerContext) -> rollout_pb2.LoadWeightsResponse:
        core = self.core
        manifest, tensors = await receive(request_iterator, core.files.payload_limit())
        await core.load(convert.policy_payload(manifest, tensors))
        return rollout_pb2.LoadWeightsResponse(job_id=manifest.job_id, version=manifest.version)

    async def UnloadAdapter(self, request: rollout_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
                            ) -> rollout_pb2.UnloadAdapterResponse:
        await self.core.unload(request.job_id, request.version)
        return rollout_pb2.UnloadAdapterResponse()

    async def Pause(self, request: rollout_pb2.PauseRequest, context: grpc.aio.ServicerContext
                    ) -> rollout_pb2.PauseResponse:
        await self.core.pause()
        return rollout_pb2.PauseResponse()

    async def Resume(self, request: rollout_pb2.ResumeRequest, context: grpc.aio.ServicerContext
                     ) -> rollout_pb2.ResumeResponse:
        await self.core.resume()
        return rollout_pb2.ResumeResponse()

    async def Abort(self, request: rollout_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> rollout_pb2.AbortResponse:
        return rollout_pb2.AbortResponse(aborted=await self.core.abort(list(request.request_ids)))


def registration(servicer: RolloutServicer) -> Register:
    """Adds `servicer` to a server; returns the service names for health and reflection."""

    def register(server: grpc.aio.Server) -> list[str]:
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return register


def attach_teacher_engines(core: RolloutCore, config: RolloutServiceConfig) -> None:
    """The full-model teachers' engines (rollout.teacher_engines) reachable from ``core``, called with the token
    this replica itself accepts (the stack's) and the stack's peer TLS."""
    if not config.rollout.teacher_engines:
        return
    from lorarl.common.auth import server_token
    from lorarl.rollout.teacher_engines import TeacherEngines

    core.teacher_engines = TeacherEngines(config.rollout.teacher_engines,
                                          token=server_token(config.server.auth, host=config.server.host),
                                          tls=peer_tls(config.server.peer_tls))


async def start_rollout(config: RolloutServiceConfig, core: RolloutCore | None
                        ) -> tuple[RunningServer, RolloutServicer]:
    """Serves an already started core in this event loop (tests, benchmarks); stop() leaves the core open (and its
    teacher engines' channels: core.teacher_engines.close())."""
    if core is not None:
        attach_teacher_engines(core, config)
    servicer = RolloutServicer(config.rollout, core)
    running = await start_server(NAME, config.server, registration(servicer))
    return running, servicer


async def serve_forever(config: RolloutServiceConfig) -> None:
    """Starts the engine (if a model is configured), then runs the rollout service until SIGTERM/SIGINT."""
    core = None
    if config.rollout.model_path is not None:
        from lorarl.common.parent_watch import mark
        from lorarl.rollout.factory import start_core
        from lorarl.rollout.vllm.core_process import declare_fork_safe

        mark()  # vLLM's engine core exits when this process dies, even by SIGKILL
        declare_fork_safe()  # nothing has run here yet: vLLM's engine core may be forked (core_process.py)

        core = await start_core(config.rollout)
    servicer = RolloutServicer(config.rollout, core)
    agent = openai = None
    ready_extra: dict[str, object] = {}
    if core is not None:  # what the engine serves as adapters: a launcher's stack.json, for jobs that attach
        info = core.info
        ready_extra["lora"] = {"supports_lora": info.supports_lora, "engine": info.engine,
                               "max_lora_rank": info.max_lora_rank if info.supports_lora else 0,
                               "reason": info.lora_reason}

    async def connect(running: RunningServer) -> None:
        """Once the port is bound, before the ready file: subscribe to weight sync with the address clients
        reach this replica at (the RL loop learns the fleet from it), and open the OpenAI-compatible endpoint."""
        nonlocal agent, openai
        from lorarl.common.auth import server_token

        token = server_token(config.server.auth, host=config.server.host)
        if core is not None:  # before weight sync lists this replica: its first Generate may name them
            attach_teacher_engines(core, config)
        if core is not None and config.rollout.weightsync_address:
            from lorarl.rollout.sync import advertised_address, start_sync_agent, wait_connected

            address = advertised_address(config.rollout.advertise_address, config.server.host, running.port,
                                         config.rollout.weightsync_address)
            agent = start_sync_agent(core, target=config.rollout.weightsync_address, replica_id=servicer.replica_id,
                                     token=token, backends=config.rollout.collective_backends,
                                     host=config.rollout.sync_host, device=config.rollout.device,
                                     tls=peer_tls(config.server.peer_tls), serve_address=address)
            await wait_connected(agent, 60.0)
        if core is not None and config.rollout.openai_port is not None:
            from lorarl.rollout.openai.http_server import start_openai_server

            openai = await start_openai_server(core, config.server.host, config.rollout.openai_port, token,
                                               config.rollout.openai_max_sessions, config.server.tls)
            ready_extra.update(openai_port=openai.port, openai_scheme=openai.scheme)

    async def shutdown() -> None:
        if openai is not None:
            await openai.stop()
        if agent is not None:
            agent.stop()
        if core is not None:
            if core.teacher_engines is not None:
                await core.teacher_engines.close()
            await core.close()

    # The engine's death ends the service (NOT_SERVING, exit 1): its supervisor restarts it whole.
    await serve(NAME, config.server, registration(servicer), on_shutdown=shutdown,
                watch=core.wait_dead if core is not None else None, ready_extra=ready_extra, before_ready=connect)
