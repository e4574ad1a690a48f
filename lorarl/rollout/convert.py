"""Plain rollout data to protobuf responses, and weight payloads (manifests, PolicyUpdates) to PolicyPayloads."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.lora import LoraSpec
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.core import ReplicaStatus
from lorarl.rollout.payloads import PolicyPayload
from lorarl.rollout.schema import Completion, CompletionChunk, EngineInfo, Finish, Mode
from lorarl.v1 import common_pb2, rollout_pb2
from lorarl.weightsync.wire.payload import version_fingerprint

FINISH_TO_PROTO = {
    Finish.STOP: common_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: common_pb2.FINISH_REASON_ABORT,
}
MODE_TO_PROTO = {Mode.ADAPTER: common_pb2.SYNC_MODE_ADAPTER, Mode.MERGED: common_pb2.SYNC_MODE_MERGED}
MODE_FROM_PROTO = {v: k for k, v in MODE_TO_PROTO.items()}


def top_logprobs(top: list[dict[int, float]]) -> list[rollout_pb2.TopLogprobs]:
    return [rollout_pb2.TopLogprobs(token_ids=list(t), logprobs=list(t.values())) for t in top]


def completion(c: Completion, prompt_tokens: int) -> rollout_pb2.Completion:
    out = rollout_pb2.Completion(token_ids=c.token_ids, logprobs=c.logprobs, token_versions=c.versions,
                                 finish_reason=FINISH_TO_PROTO[c.finish], text=c.text,
                                 top_logprobs=top_logprobs(c.top_logprobs),
                                 teacher_logprobs=c.teacher_logprobs or [])
    for version, weights in c.fingerprints.items():
        out.policy_fingerprints[version] = weights
    if c.routes is not None:  # exactly the sequence's routed positions: all its tokens but the last
        out.routed_experts.CopyFrom(c.routes.truncated(prompt_tokens + len(c.token_ids) - 1).to_proto())
    return out


def stream_chunk(chunk: CompletionChunk) -> rollout_pb2.GenerateStreamResponse:
    finish = FINISH_TO_PROTO[chunk.finish] if chunk.finish is not None else common_pb2.FINISH_REASON_UNSPECIFIED
    return rollout_pb2.GenerateStreamResponse(index=chunk.index, token_ids=chunk.token_ids, logprobs=chunk.logprobs,
                                              token_versions=chunk.versions, finish_reason=finish,
                                              top_logprobs=top_logprobs(chunk.top_logprobs))


def capabilities(info: EngineInfo, settings: RolloutSettings, fingerprint: str) -> rollout_pb2.GetCapabilitiesResponse:
    modes = [common_pb2.SYNC_MODE_ADAPTER, common_pb2.SYNC_MODE_MERGED] if info.supports_lora \
        else [common_pb2.SYNC_MODE_MERGED]
    return rollout_pb2.GetCapabilitiesResponse(
        engine=info.engine, supports_lora=info.supports_lora, max_lora_rank=info.max_lora_rank,
        max_loras=info.max_loras, modes=modes, base_model_fingerprint=fingerprint, vocab_size=info.vocab_size,
        max_model_len=info.max_model_len, reason=info.lora_reason,
        adapter_window=settings.window if info.supports_lora else 0, dtype=info.dtype,
        shared=bool(settings.base_write_refusal()))


def replica_status(status: ReplicaStatus, replica_id: str) -> rollout_pb2.GetReplicaStatusResponse:
    return rollout_pb2.GetReplicaStatusResponse(
        replica_id=replica_id, paused=status.paused, requests_in_flight=status.in_flight,
        requests_queued=status.queued, peak_running_requests=status.peak_running,
        policies=[rollout_pb2.LoadedPolicy(job_id=p.job_id, version=p.version, mode=MODE_TO_PROTO[p.mode],
                                           requests_in_flight=p.in_flight, active=p.active)
                  for p in status.policies])




def policy_payload(manifest: common_pb2.WeightManifest, tensors: Mapping[str, torch.Tensor],
                   serve_mode: int | None = None) -> PolicyPayload:
    """A PolicyPayload for verified tensors; serve_mode defaults to the manifest's mode."""
    mode = MODE_FROM_PROTO.get(manifest.mode)
    if mode is None:
        raise InvalidArgumentError("manifest.mode", "must be SYNC_MODE_ADAPTER or SYNC_MODE_MERGED")
    serve = MODE_FROM_PROTO.get(serve_mode, mode) if serve_mode else mode
    lora = None
    if manifest.HasField("lora") and manifest.lora.rank:
        try:
            lora = LoraSpec.from_proto(manifest.lora)
        except ValueError as e:
            raise InvalidArgumentError("manifest.lora", str(e)) from None
    if mode is Mode.ADAPTER and lora is None:
        raise InvalidArgumentError("manifest.lora", "an adapter manifest needs its LoRA spec (rank, alpha)")
    return PolicyPayload(job_id=manifest.job_id, version=manifest.version, mode=mode, serve_mode=serve,
                         fingerprint=manifest.base_model_fingerprint, tensors=tensors, lora=lora,
                         weights=version_fingerprint(manifest))
