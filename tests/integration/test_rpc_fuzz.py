"""A compact fuzz of every RPC of the three services, running for real on loopback.

Each RPC gets: no token, a wrong token, bytes that are no protobuf, the empty message, and one
message per field with that field set to a hostile value (huge, negative, NaN/inf, NUL and newline
strings, unknown enum numbers, long lists), one nesting level deep. What must hold for every call:
no UNKNOWN and no INTERNAL status, every unauthenticated call UNAUTHENTICATED, every status message
short (inputs are quoted cut), and all three services still SERVING at the end.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorarl.common.channel import sync_channel
from lorarl.common.server import start_server
from lorarl.common.server_config import AuthConfig, ServerConfig
from lorarl.rollout.config import RolloutServiceConfig, RolloutSettings
from lorarl.rollout.factory import start_core
from lorarl.rollout.server import start_rollout
from lorarl.trainer.service.config import TrainerSettings
from lorarl.trainer.service.server import TrainerServicer
from lorarl.trainer.service.server import registration as trainer_registration
from lorarl.v1 import common_pb2, rollout_pb2, trainer_pb2, trainer_pb2_grpc, weightsync_pb2, weightsync_pb2_grpc
from lorarl.weightsync.service.config import WeightSyncServiceConfig, WeightSyncSettings
from lorarl.weightsync.service.server import start_weightsync
from tests.unit.rollout.models import dense_model_dir
from tests.unit.weightsync.fixtures import adapter, manifest_of, register_request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "fuzz-token"
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"
#: Calls that may wait by design (a subscription stream, an activation wait): a deadline is their answer.
WAITING = {"Subscribe", "AwaitActivation"}
F = pb_descriptor.FieldDescriptor
HUGE_TEXT = "x" * 100_000


def hostile_values(field: pb_descriptor.FieldDescriptor) -> list[Any]:
    """Values of ``field``'s type that a careless server mishandles."""
    if field.type == F.TYPE_STRING:
        return [HUGE_TEXT, "a\x00b", "../../etc/passwd", "job\nid", "-"]
    if field.type == F.TYPE_BYTES:
        return [b"\xff" * 1000]
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return [math.nan, math.inf, -math.inf, -1.0, 3.0e38]
    if field.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return [2**31 - 1, -(2**31)]
    if field.type in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return [2**63 - 1, -(2**63)]
    if field.type in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return [2**32 - 1]
    if field.type in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return [2**64 - 1]
    if field.type == F.TYPE_BOOL:
        return [True]
    if field.type == F.TYPE_ENUM:
        return [9999, max(v.number for v in field.enum_type.values)]
    return []


def set_value(message: Any, field: pb_descriptor.FieldDescriptor, value: Any) -> None:
    if field.is_repeated:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, val = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            k = hostile_values(key)[0] if key.type == F.TYPE_STRING else 1
            getattr(message, field.name)[k] = value if val.type != F.TYPE_MESSAGE else None
            return
        getattr(message, field.name).extend([value] * (1000 if not isinstance(value, str) else 3))
    else:
        setattr(message, field.name, value)


def fuzzed_messages(descriptor: pb_descriptor.Descriptor, depth: int = 1, base: Any = None
                    ) -> Iterator[tuple[str, Any]]:
    """(description, message): ``base`` (default: the empty message) with one field, or one field of one
    sub-message, set to a hostile value."""
    proto = message_factory.GetMessageClass(descriptor)

    def cls() -> Any:
        message = proto()
        if base is not None:
            message.CopyFrom(base)
        return message

    for field in descriptor.fields:
        if field.type == F.TYPE_MESSAGE:
            is_map = field.message_type.GetOptions().map_entry
            if depth == 0 or is_map:
                if is_map:
                    val = field.message_type.fields_by_name["value"]
                    for value in hostile_values(val)[:2]:
                        message = cls()
                        try:
                            set_value(message, field, value)
                        except (TypeError, ValueError):
                            continue
                        yield f"{field.name}[]={value!r:.40}", message
                continue
            inner_base = None
            if base is not None:
                held = getattr(base, field.name)
                if field.is_repeated:
                    inner_base = held[0] if len(held) else None
                elif base.HasField(field.name):
                    inner_base = held
            for inner, sub in fuzzed_messages(field.message_type, depth - 1, inner_base):
                message = cls()
                if field.is_repeated:
                    del getattr(message, field.name)[:]
                    getattr(message, field.name).append(sub)
                else:
                    getattr(message, field.name).CopyFrom(sub)
                yield f"{field.name}.{inner}", message
            continue
        for value in hostile_values(field):
            message = cls()
            if field.is_repeated:
                message.ClearField(field.name)
            try:
                set_value(message, field, value)
            except (TypeError, ValueError):  # a value the message itself refuses (e.g. NUL in a map key)
                continue
            yield f"{field.name}={value!r:.40}", message


class Stack:
    """The three services in one event loop on a background thread."""

    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tmp = tmp
        self.servers: dict[str, Any] = {}

    def call(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def server_config(self) -> ServerConfig:
        return ServerConfig(port=0, metrics_port=-1, shutdown_grace_s=0.2, auth=AuthConfig(token=TOKEN))

    def start(self) -> Stack:
        ws_config = WeightSyncServiceConfig(server=self.server_config(),
                                            weightsync=WeightSyncSettings(storage_dir=str(self.tmp / "ws")))
        self.servers["weightsync"], _ = self.call(start_weightsync(ws_config))
        trainer = TrainerSettings(checkpoint_dir=str(self.tmp / "ckpt"), export_dir=str(self.tmp / "export"))

        async def start_trainer() -> Any:
            return await start_server("trainer", self.server_config(), trainer_registration(TrainerServicer(trainer)))

        self.servers["trainer"] = self.call(start_trainer())
        settings = RolloutSettings(model_path=str(dense_model_dir()), engine="hf", dtype="float32", max_model_len=256)
        self.core = self.call(start_core(settings))
        config = RolloutServiceConfig(server=self.server_config(), rollout=settings)
        self.servers["rollout"], _ = self.call(start_rollout(config, self.core))
        self.baselines = baselines()
        # the job every baseline names, on the trainer and on the weight-sync service
        with sync_channel(self.servers["trainer"].address, token=TOKEN) as channel:
            trainer_pb2_grpc.TrainerServiceStub(channel).CreateJob(self.baselines["CreateJob"], timeout=60)
        with sync_channel(self.servers["weightsync"].address, token=TOKEN) as channel:
            weightsync_pb2_grpc.WeightSyncServiceStub(channel).RegisterJob(self.baselines["RegisterJob"], timeout=60)
        return self

    def close(self) -> None:
        for running in self.servers.values():
            self.call(running.stop(0))
        self.call(self.core.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


PROMPT = [1, 5, 9, 13]


def trajectory() -> common_pb2.Trajectory:
    return common_pb2.Trajectory(prompt_token_ids=PROMPT, completion_token_ids=[3, 4], behavior_logprobs=[-1.0, -1.0],
                                 token_versions=[0, 0], reward=1.0, group_id="g", job_id="fuzz",
                                 finish_reason=common_pb2.FINISH_REASON_STOP)


def baselines() -> dict[str, Any]:
    """A valid request per RPC (by method name) for the mutations to start from: they then reach past
    the first check. The job "fuzz" exists on the trainer and the weight-sync service."""
    job = trainer_pb2.JobConfig(base_model_path=str(dense_model_dir()), lora=common_pb2.LoraSpec(rank=4, alpha=8),
                                optimizer=trainer_pb2.OptimizerConfig(learning_rate=1e-3), seed=1)
    sampling = common_pb2.SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3)
    manifest, _ = manifest_of(adapter(), job_id="fuzz")
    return {
        "CreateJob": trainer_pb2.CreateJobRequest(job_id="fuzz", config=job),
        "GetJob": trainer_pb2.GetJobRequest(job_id="fuzz"),
        "PushTrajectories": trainer_pb2.PushTrajectoriesRequest(job_id="fuzz", trajectories=[trajectory()]),
        "ForwardBackward": trainer_pb2.ForwardBackwardRequest(job_id="fuzz", trajectories=[trajectory()]),
        "OptimStep": trainer_pb2.OptimStepRequest(job_id="fuzz", learning_rate=1e-3),
        "ComputeLogprobs": trainer_pb2.ComputeLogprobsRequest(job_id="fuzz", trajectories=[trajectory()]),
        "SaveCheckpoint": trainer_pb2.SaveCheckpointRequest(job_id="fuzz", path="ckpt"),
        "LoadCheckpoint": trainer_pb2.LoadCheckpointRequest(job_id="fuzz", path="ckpt"),
        "Export": trainer_pb2.ExportRequest(job_id="fuzz", path="out"),
        "Generate": rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=PROMPT)], sampling=sampling,
                                                request_id="fuzz"),
        "GenerateStream": rollout_pb2.GenerateStreamRequest(prompt=rollout_pb2.Prompt(token_ids=PROMPT),
                                                            sampling=sampling),
        "LoadWeights": rollout_pb2.LoadWeightsRequest(manifest=manifest),  # a first message: bucket sizes etc.
        "RegisterJob": register_request(job_id="fuzz"),
        "UploadWeights": weightsync_pb2.UploadWeightsRequest(job_id="fuzz", version=1),
        "PublishManifest": weightsync_pb2.PublishManifestRequest(manifest=manifest),
        "GetManifest": weightsync_pb2.GetManifestRequest(job_id="fuzz", version=1),
        "FetchWeights": weightsync_pb2.FetchWeightsRequest(job_id="fuzz", version=1),
        "AwaitActivation": weightsync_pb2.AwaitActivationRequest(job_id="fuzz", version=1, timeout_seconds=1),
        "ReportStaged": weightsync_pb2.ReportStagedRequest(replica_id="r", job_id="fuzz", version=1, ok=True),
        "GetSyncStatus": weightsync_pb2.GetSyncStatusRequest(job_id="fuzz"),
    }


SERVICES = {"trainer": (trainer_pb2, "TrainerService"), "rollout": (rollout_pb2, "RolloutService"),
            "weightsync": (weightsync_pb2, "WeightSyncService")}


def invoke(channel: grpc.Channel, service: str, method: pb_descriptor.MethodDescriptor, body: bytes,
           timeout: float) -> tuple[grpc.StatusCode, str]:
    """Sends ``body`` (raw bytes: no serializer) to the method, reads any responses; the final status."""
    path = f"/{service}/{method.name}"
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path)(iter([body]), timeout=timeout):
                pass
        elif method.client_streaming:
            channel.stream_unary(path)(iter([body]), timeout=timeout)
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(body, timeout=timeout):
                pass
        else:
            channel.unary_unary(path)(body, timeout=timeout)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(tmp_path_factory.mktemp("fuzz")).start()
    yield running
    running.close()


@pytest.mark.parametrize("name", list(SERVICES))
def test_every_rpc_answers_bad_input_with_a_status_that_names_it(stack: Stack, name: str) -> None:
    module, service_name = SERVICES[name]
    service = module.DESCRIPTOR.services_by_name[service_name]
    address = stack.servers[name].address
    offenders: list[str] = []
    calls = 0
    with sync_channel(address, token=TOKEN) as authorised, sync_channel(address) as anonymous, \
            sync_channel(address, token="wrong-" + TOKEN) as wrong:
        for method in service.methods:
            empty = message_factory.GetMessageClass(method.input_type)().SerializeToString()
            for label, channel in (("no token", anonymous), ("wrong token", wrong)):
                code, _ = invoke(channel, service.full_name, method, empty, timeout=10)
                calls += 1
                if code != grpc.StatusCode.UNAUTHENTICATED:
                    offenders.append(f"{method.name} with {label}: {code.name}")
            code, _ = invoke(anonymous, service.full_name, method, GARBAGE, timeout=10)
            calls += 1
            if code != grpc.StatusCode.UNAUTHENTICATED:
                offenders.append(f"{method.name} garbage without a token: {code.name}")
            cases = [("garbage", GARBAGE), ("empty", empty)]
            cases += [(what, message.SerializeToString()) for what, message in fuzzed_messages(method.input_type)]
            base = stack.baselines.get(method.name)
            if base is not None:
                cases += [(f"valid but {what}", message.SerializeToString())
                          for what, message in fuzzed_messages(method.input_type, base=base)]
            for what, body in cases:
                code, details = invoke(authorised, service.full_name, method, body, timeout=5 if method.name in WAITING
                                       else 60)
                calls += 1
                if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) or len(details) > 2000 or (
                        code == grpc.StatusCode.DEADLINE_EXCEEDED and method.name not in WAITING) or (
                        what == "garbage" and code != grpc.StatusCode.INVALID_ARGUMENT):
                    offenders.append(f"{method.name}({what}): {code.name} {details[:300]!r}")
        health = health_pb2_grpc.HealthStub(authorised).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert calls > 50
    assert offenders == [], f"{len(offenders)} of {calls} calls:\n" + "\n".join(offenders)
