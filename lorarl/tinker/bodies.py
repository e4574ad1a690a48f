"""The Tinker API's JSON request bodies, typed at the door by the SDK's own request models (`tinker.types`,
pydantic, extra fields forbidden), as SkyRL-tx's `tx/tinker/api.py` types its bodies: a malformed field is a 400
naming it before any handler reads the body, never a 500 from deep inside one (which the SDK retries for
minutes). The SDK is the reference: a body the official client sends validates by construction."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from tinker import types

from lorarl.tinker.futures import UserError

T = TypeVar("T", bound=BaseModel)


class WeightsInfoRequest(BaseModel):
    """POST /weights_info, as tinker.RestClient.get_weights_info_by_tinker_path sends it (the SDK has no model)."""

    model_config = ConfigDict(extra="forbid")
    tinker_path: str


class CheckpointTtlRequest(BaseModel):
    """PUT /training_runs/{run}/checkpoints/{checkpoint}/ttl, as tinker.RestClient.set_checkpoint_ttl_from_tinker_path
    sends it (the SDK has no model): seconds from now, or null to keep the checkpoint."""

    model_config = ConfigDict(extra="forbid")
    ttl_seconds: int | None


#: Route name (the path after /api/v1/) -> the SDK's model of its body.
BODIES: dict[str, type[BaseModel]] = {
    "create_session": types.CreateSessionRequest,
    "session_heartbeat": types.SessionHeartbeatRequest,
    "create_model": types.CreateModelRequest,
    "get_info": types.GetInfoRequest,
    "optim_step": types.OptimStepRequest,
    "save_weights_for_sampler": types.SaveWeightsForSamplerRequest,
    "save_weights": types.SaveWeightsRequest,
    "load_weights": types.LoadWeightsRequest,
    "create_sampling_session": types.CreateSamplingSessionRequest,
    "asample": types.SampleRequest,
    "retrieve_future": types.FutureRetrieveRequest,
    "weights_info": WeightsInfoRequest,
    "ttl": CheckpointTtlRequest,
}
#: The most field problems one refusal lists.
MAX_PROBLEMS = 3


def typed(model: type[T], body: Any) -> T:
    """``body`` as ``model``, or a UserError (HTTP 400) naming each bad field, what is wrong and what was sent."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        problems = []
        for error in e.errors()[:MAX_PROBLEMS]:
            where = ".".join(str(part) for part in error["loc"]) or "body"
            sent = repr(error.get("input"))
            problems.append(f"{where}: {error['msg']} (got {sent[:60]}{'...' if len(sent) > 60 else ''})")
        more = f"; and {e.error_count() - MAX_PROBLEMS} more" if e.error_count() > MAX_PROBLEMS else ""
        raise UserError(f"{model.__name__}: {'; '.join(problems)}{more}") from None


def checked(route: str, body: Any) -> dict[str, Any]:
    """``body`` once it validates as its route's SDK model (the handlers read the JSON as sent)."""
    typed(BODIES[route], body)
    return body
