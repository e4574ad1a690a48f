"""Full-model teachers: on-policy distillation's teachers that are not adapters on this replica's base but models
of their own, each served by an engine of its own (another rollout service, rollout.teacher_engines).

lorarl.rollout.teachers scores adapter teachers in this engine; a teacher whose PolicyRef names an engine sends the
same prefill-only rows (prompt + completion as the prompt, its logprobs asked, one token sampled and thrown away)
to that engine's Generate RPC instead, so the weighted mixture and the per-token alignment stay in one place. The
teacher's model must read the same token ids (the job's dry run refuses another tokenizer by name); its engine
checks each row against its own vocabulary and length, and its refusal is passed on with the engine's name.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from lorarl.common.channel import ClientTls, aio_channel
from lorarl.common.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from lorarl.rollout.schema import Completion, Finish, GenerateInput, PromptResult
from lorarl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


def engine_error(where: str, e: grpc.aio.AioRpcError) -> Exception:
    """What the student's caller is told of a teacher engine's failure, by what the caller can do about it: wait
    (busy: RESOURCE_EXHAUSTED), retry elsewhere or later (the engine down: UNAVAILABLE), or nothing — a refusal, a
    token or TLS mismatch or the engine's own fault is permanent (FAILED_PRECONDITION / INTERNAL, never retried
    as if the student's replica were gone)."""
    code, message = e.code(), f"{where}: {e.code().name}: {e.details()}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhaustedError(message)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return UnavailableError(message)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND):
        return FailedPreconditionError(f"{message} (the teacher's engine refused the student's rows, or this "
                                       "replica's token or TLS: fix its settings)")
    return InternalError(message)


class TeacherEngines:
    """Channels to the teacher engines named in rollout.teacher_engines (opened at first use, in the serving loop),
    and the one call lorarl.rollout.teachers makes of them."""

    def __init__(self, addresses: Mapping[str, str], token: str | None = None, tls: ClientTls | None = None) -> None:
        self.addresses = dict(addresses)
        self._token, self._tls = token, tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, name: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if name not in self.addresses:  # validation refuses such a request first; kept for direct callers
            raise InvalidArgumentError("teachers.engine", f"no teacher engine {name!r} "
                                                          f"(known: {sorted(self.addresses)})")
        if name not in self._channels:
            self._channels[name] = aio_channel(self.addresses[name], token=self._token, tls=self._tls)
        return rollout_pb2_grpc.RolloutServiceStub(self._channels[name])

    async def generate(self, request: GenerateInput) -> list[PromptResult]:
        """``request`` (a teacher's scoring rows: lorarl.rollout.teachers.SCORING) run on its teacher's engine; each
        row's prompt logprobs, as this engine's own generate returns them."""
        name = request.policy.engine
        s = request.sampling
        proto = rollout_pb2.GenerateRequest(
            request_id=request.request_id,
            prompts=[rollout_pb2.Prompt(token_ids=list(p)) for p in request.prompts],
            sampling=common_pb2.SamplingParams(n=s.n, temperature=s.temperature, max_tokens=s.max_tokens,
                                               prompt_logprobs=s.prompt_logprobs))
        try:
            response = await self._stub(name).Generate(proto)
        except grpc.aio.AioRpcError as e:
            raise engine_error(f"teacher engine {name!r} at {self.addresses[name]}", e) from None
        return [PromptResult(prompt_token_ids=list(r.prompt_token_ids),
                             completions=[Completion(token_ids=list(c.token_ids), finish=Finish.LENGTH)
                                          for c in r.completions],
                             prompt_logprobs=list(r.prompt_logprobs))
                for r in response.results]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
