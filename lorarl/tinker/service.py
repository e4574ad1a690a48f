"""The Tinker API's calls as lorarl gRPC calls: one lorarl job per Tinker training model, its versions
served by the rollout for sampling sessions. Plain async methods returning JSON dicts or protobuf bytes;
`app.py` puts them on HTTP and `futures.py` runs them in each model's order.

What the front does not serve is refused by name (a "user" error the SDK raises), never dropped:
image chunks, sparse or 2-D targets, losses other than cross_entropy / importance_sampling / ppo / cispo (dro,
gspo, stable_reinforce and a server-side custom loss are refused), optimizers other than Adam. Adam's learning
rate, betas, eps, weight decay and clipping go per optim_step as the SDK sends them (the optimizer's moments
are the job's, its hyperparameters the caller's). The unembedding is not adapted (lorarl adapts decoder
linears): `train_unembed` is accepted and logged, since the SDK sends it by default.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from lorarl.common.channel import ClientTls, aio_channel
from lorarl.contract.lora import ALL_LINEAR, ATTENTION_TARGETS, MLP_TARGETS, LoraSpec
from lorarl.contract.training import AdamStep, LossSpec, OptimizerSpec, TrainingSpec
from lorarl.tinker import wire
from lorarl.tinker.futures import UserError
from lorarl.tinker.runs import Run, Runs
from lorarl.tinker.state import FrontState, Kinds, Snapshot
from lorarl.tinker.tenants import DEFAULT_TENANT, FrontTenant, FrontTenants
from lorarl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

logger = logging.getLogger(__name__)

#: What a Tinker model's Adam runs with unless a step says otherwise (the SDK's AdamParams defaults).
TINKER_ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
#: AdamParams' names -> lorarl's per-step optimizer fields (lorarl.contract.training.AdamStep).
ADAM_FIELDS = {"beta1": "beta1", "beta2": "beta2", "eps": "eps", "weight_decay": "weight_decay",
               "grad_clip_norm": "max_grad_norm"}


@dataclass
class Model:
    model_id: str
    job_id: str
    base_model: str
    rank: int
    version: int = 0  # the trainer's, after this model's last optim_step (0: untrained, the base's outputs)
    tenant: str = DEFAULT_TENANT  # whose it is (lorarl.tinker.tenants)


@dataclass(frozen=True)
class Saved:
    """A save_state checkpoint: where the trainer wrote it and what it was trained from."""

    checkpoint: str
    adapter: str  # the same weights as a PEFT adapter: a weights-only load warm-starts a job from it
    base_model: str
    rank: int
    lora: dict[str, Any]
    tenant: str = DEFAULT_TENANT  # whose path it is: only its keys load it
    expires_at: float = 0.0  # wall-clock seconds when the path expires (its ttl_seconds; 0: never)


#: How long a session may go without a heartbeat or a call before it expires and frees what it holds. The SDK
#: heartbeats every 10 s and warns its user after 120 s without one that "the session will be terminated".
SESSION_TTL_S = 300.0

#: The most top logprobs per token a sample returns (the rollout's bound, OpenAI's too).
MAX_TOPK = 20

#: A saved path's ttl_seconds, as the SDK documents it: 1 hour to 10 years.
TTL_RANGE_S = (3600, 10 * 365 * 24 * 3600)


@dataclass(frozen=True)
class SampleShape:
    """What a sample's response holds beside the samples: the prompt tokens scored (the last n; None: all),
    and how many top alternatives per prompt token and per sampled token (0: none)."""

    last_n: int | None = None
    topk_prompt: int = 0
    topk_sample: int = 0


@dataclass
class Sampler:
    """What a sampling session samples: a base model, or one version of a job's adapter. Sessions opened on one
    ``tinker://`` path share the object, so a restore (`TinkerService._restore`) moves them all."""

    base_model: str
    job_id: str = ""  # empty: the base model
    version: int = 0
    model_path: str = ""
    adapter: str = ""  # the same weights as a PEFT adapter (the trainer's export): what a restore loads
    lora: dict[str, Any] | None = None  # the create_model lora_config they were trained with
    tenant: str = DEFAULT_TENANT  # whose path it is: only its keys open sampling sessions on it
    expires_at: float = 0.0  # wall-clock seconds when the path expires (its ttl_seconds; 0: never)


#: How many sampler paths the front keeps restored at once (each a trainer job and an adapter slot on the
#: rollout); the least recently restored goes first, and is restored again if it is sampled again.
MAX_RESTORED = 2


#: The gRPC refusals that are the caller's doing (a bad argument, a missing job): a "user" error, by its message.
USER_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED)


def refusal(error: grpc.aio.AioRpcError) -> Exception:
    """What the client is told of a failed call: a UserError for USER_CODES, else the error as it is."""
    return UserError(f"{error.code().name}: {error.details()}") if error.code() in USER_CODES else error


class TinkerService:
    """Sessions, models and samplers over a trainer (and a rollout, for sampling)."""

    def __init__(self, models: dict[str, str], trainer: str, rollout: str = "", token: str | None = None,
                 session_ttl_s: float = SESSION_TTL_S, clock: Callable[[], float] = time.monotonic,
                 tls: ClientTls | None = None, state_path: str | Path | None = None,
                 tenants: FrontTenants | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        """``models``: Tinker base-model name -> the model's directory on the trainer and rollout;
        ``session_ttl_s``: silence after which a session expires (`expire_silent`); ``tls``: how the calls to the
        trainer and rollout are secured (the stack's ``server.peer_tls``; None: plaintext); ``state_path``: the
        file the front's state is kept in across a restart (lorarl.tinker.state; None: memory);
        ``tenants``: who may call, their limits and trainer keys (None: one tenant, DEFAULT_TENANT);
        ``wall_clock``: what saved paths' ttl_seconds count against."""
        self.base_models = dict(models)
        self.tenants = tenants or FrontTenants([FrontTenant(DEFAULT_TENANT, ())])
        self._trainer_channel = aio_channel(trainer, token=token, tls=tls)
        self.trainer = trainer_pb2_grpc.TrainerServiceStub(self._trainer_channel)
        # a tenant with a key of its own on the trainer calls with it: the trainer confines it to its jobs
        self._tenant_channels = {t.name: aio_channel(trainer, token=t.trainer_token, tls=tls)
                                 for t in self.tenants.by_name.values() if t.trainer_token}
        self._trainers = {name: trainer_pb2_grpc.TrainerServiceStub(channel)
                          for name, channel in self._tenant_channels.items()}
        self._rollout_channel = aio_channel(rollout, token=token, tls=tls) if rollout else None
        self.rollout = rollout_pb2_grpc.RolloutServiceStub(self._rollout_channel) if self._rollout_channel else None
        self._creating: dict[str, int] = {}  # tenant -> create_model calls under way (counted against max_models)
        # told each model that ends with its session (app.py fails its requests still waiting for their turn)
        self.on_model_ended: Callable[[str], None] = lambda model_id: None
        self.session_ttl_s, self._clock, self._wall = session_ttl_s, clock, wall_clock
        self._restore_lock: asyncio.Lock | None = None  # made in the serving loop, on the first restore
        self.state = FrontState(state_path)
        kept = self.state.load(Kinds(Saved, Sampler, Model, Run))  # what a front killed before held
        # tinker://<model_id>/weights/<name> -> the trainer's checkpoint; .../sampler_weights/<name> -> its sampler;
        # the tinker paths deleted through the REST API
        self.saved, self._paths, self._deleted = kept.saved, kept.paths, kept.deleted
        self.session_owner: dict[str, str] = dict(kept.sessions)  # session_id -> its tenant
        self.sessions: dict[str, set[str]] = {s: set() for s in kept.sessions}  # session_id -> its model ids
        self.models: dict[str, Model] = dict(kept.models)  # their trainer jobs outlived the front
        for model_id in self.models:
            self.sessions.setdefault(model_id.split(":train:", 1)[0], set()).add(model_id)
        self._lora_of: dict[str, dict[str, Any]] = dict(kept.lora)  # model_id -> its create_model lora_config
        self.samplers: dict[str, Sampler] = {}
        self.sampler_owner: dict[str, str] = {}  # sampler_id -> the tenant that opened it
        for sampler_id, record in kept.sampling.items():
            found = self._paths.get(record.get("path", "")) or Sampler(record.get("base_model", ""),
                                                                      tenant=record["owner"])
            self.samplers[sampler_id], self.sampler_owner[sampler_id] = found, record["owner"]
        now = clock()
        self._last_seen: dict[str, float] = {s: now for s in self.sessions}  # their silence counts from now
        self.runs = Runs(kept.runs)  # the REST API's training runs and checkpoints (they outlive their sessions)
        # restore job id -> the sampler it serves, oldest first
        self._restored: dict[str, Sampler] = {r: self._paths[p] for r, p in kept.restored.items() if p in self._paths}
        self.on_rollout: dict[str, str] = dict(kept.on_rollout)  # job id the rollout holds for sampling -> tenant

    async def close(self) -> None:
        await self._trainer_channel.close()
        for channel in self._tenant_channels.values():
            await channel.close()
        if self._rollout_channel is not None:
            await self._rollout_channel.close()

    # ------------------------------------------------------------ sessions and models

    async def reconcile(self) -> list[str]:
        """After a restart: the kept models whose trainer jobs are gone (the services were restarted too, as
        `lorarl tinker` does) are dropped, with their rollout slots, rather than answering with a missing job;
        their sessions and saved paths stay. The model ids dropped."""
        if not self.models and not self.on_rollout:
            return []
        try:
            listed = await self.trainer.ListJobs(trainer_pb2.ListJobsRequest())
        except grpc.aio.AioRpcError as e:
            logger.warning("could not list the trainer's jobs to check the kept models: %s", e.details())
            return []
        alive = {job.job_id for job in listed.jobs}
        gone = [m for m, model in self.models.items() if model.job_id not in alive]
        for model_id in gone:
            logger.warning("model %s: its trainer job %s is gone (the trainer restarted); dropped", model_id,
                           self.models[model_id].job_id)
            del self.models[model_id]
            for models in self.sessions.values():
                models.discard(model_id)
        self.on_rollout = {job: tenant for job, tenant in self.on_rollout.items() if job in alive}
        self._restored = {r: sampler for r, sampler in self._restored.items() if r in alive}
        self._keep()
        return gone

    def _trainer_of(self, tenant: str) -> Any:
        """The trainer stub a tenant's calls go through (its own trainer key, else the service token)."""
        return self._trainers.get(tenant, self.trainer)

    def create_session(self, tenant: str = DEFAULT_TENANT) -> dict[str, Any]:
        session_id = f"s{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = set()
        self.session_owner[session_id] = tenant
        self._keep()
        self._last_seen[session_id] = self._clock()
        return {"session_id": session_id}

    def heartbeat(self, session_id: str, tenant: str = DEFAULT_TENANT) -> bool:
        """A session's heartbeat: False for a session that is not (or no longer) open, or not ``tenant``'s."""
        if session_id not in self.sessions or self.session_owner.get(session_id) != tenant:
            return False
        self._last_seen[session_id] = self._clock()
        return True

    async def expire_silent(self) -> list[str]:
        """Finishes every session silent for longer than ``session_ttl_s`` (a crashed or killed client never
        sends its finish): its jobs leave the trainer and its adapters the rollout, as on a finish. The ids
        expired."""
        now = self._clock()
        silent = [s for s in list(self.sessions) if now - self._last_seen.get(s, now) > self.session_ttl_s]
        for session_id in silent:
            logger.warning("session %s: no heartbeat for %.0f s (limit %.0f s); expired, its models freed",
                           session_id, now - self._last_seen[session_id], self.session_ttl_s)
            await self.finish_session(session_id)
        return silent

    async def finish_session(self, session_id: str, tenant: str | None = None) -> None:
        """A session's end (the client's close): its models' jobs leave the trainer and their adapters the rollout,
        freeing their slots and memory (on a shared rollout the adapters of finished sessions would otherwise
        fill every slot); what they saved stays loadable (create_training_client_from_state_with_optimizer).
        ``tenant``: the caller's (another tenant's session is left alone); None: the front's own (expiry)."""
        if tenant is not None and self.session_owner.get(session_id) != tenant:
            return
        self._last_seen.pop(session_id, None)
        self.session_owner.pop(session_id, None)
        for model_id in sorted(self.sessions.pop(session_id, set())):
            model = self.models.pop(model_id, None)
            if model is None:
                continue
            self.on_model_ended(model_id)
            try:
                await self._trainer_of(model.tenant).DeleteJob(trainer_pb2.DeleteJobRequest(job_id=model.job_id))
            except grpc.aio.AioRpcError as e:
                logger.warning("session %s: could not delete job %s: %s", session_id, model.job_id, e.details())
            await self._unload(model.job_id)
        self._keep()

    async def _unload(self, job_id: str) -> None:
        """Every version of ``job_id`` off the rollout (each once its requests have finished)."""
        self.on_rollout.pop(job_id, None)
        if self.rollout is None:
            return
        try:
            await self.rollout.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(job_id=job_id))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it never sampled
                logger.warning("could not unload job %s from the rollout: %s", job_id, e.details())

    def _session(self, session_id: str, tenant: str = DEFAULT_TENANT) -> set[str]:
        if session_id not in self.sessions or self.session_owner.get(session_id) != tenant:
            raise UserError(f"unknown session_id {session_id!r}: create_session first (a session silent for "
                            f"{self.session_ttl_s:.0f} s expires)")
        self._last_seen[session_id] = self._clock()
        return self.sessions[session_id]

    def model(self, model_id: str, tenant: str | None = None) -> Model:
        """The model, when ``tenant``'s (None: the front's own call, the route checked it already)."""
        if model_id not in self.models or tenant not in (None, self.models[model_id].tenant):
            raise UserError(f"unknown model_id {model_id!r}")
        session_id = model_id.split(":train:", 1)[0]
        if session_id in self._last_seen:  # a call on a session's model counts as a sign of life
            self._last_seen[session_id] = self._clock()
        self.runs.touch(model_id)
        return self.models[model_id]

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": self.rollout is not None}
                                     for name in self.base_models]}

    def _base_path(self, base_model: str) -> str:
        if base_model not in self.base_models:
            raise UserError(f"base_model {base_model!r} is not served here; this front serves "
                            f"{sorted(self.base_models)}")
        return self.base_models[base_model]

    def model_id_for(self, session_id: str, model_seq_id: int) -> str:
        return f"{session_id}:train:{model_seq_id}"

    async def create_model(self, body: dict[str, Any], init_adapter: str = "",
                           tenant: str = DEFAULT_TENANT) -> dict[str, Any]:
        session_id = str(body.get("session_id", ""))
        models = self._session(session_id, tenant)
        model_id = self.model_id_for(session_id, int(body.get("model_seq_id", 0)))
        if model_id in self.models:
            raise UserError(f"model {model_id} exists already")
        base_model = str(body.get("base_model", ""))
        lora = body.get("lora_config") or {}
        rank = int(lora.get("rank", 32))
        if lora.get("train_unembed", True):
            logger.info("model %s: train_unembed is not served; the unembedding stays frozen", model_id)
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserError(f"optimizer_config.type {optimizer!r}: lorarl serves adamw")
        spec = self._spec(base_model, lora, init_adapter)
        owner = self.tenants[tenant]
        live = sum(m.tenant == tenant for m in self.models.values()) + self._creating.get(tenant, 0)
        if live >= owner.limits.max_models:
            raise UserError(f"tenant {tenant!r} has {live} training models, its limit (tinker.tenants[].max_models "
                            f"{owner.limits.max_models}): finish a session (its models are freed) and create again")
        job_id = f"{owner.job_prefix}{session_id}-{int(body.get('model_seq_id', 0))}"
        self._creating[tenant] = self._creating.get(tenant, 0) + 1
        try:
            created = await self._call(self._trainer_of(tenant).CreateJob, trainer_pb2.CreateJobRequest(
                job_id=job_id, config=spec.to_proto()))
        finally:
            self._creating[tenant] -= 1
        self.models[model_id] = Model(model_id, job_id, base_model, rank, version=int(created.job.version),
                                      tenant=tenant)
        self._lora_of[model_id] = dict(lora)
        self.runs.add(model_id, base_model, rank, lora, owner=tenant)
        models.add(model_id)
        self._keep()
        return {"model_id": model_id, "type": "create_model"}

    def _spec(self, base_model: str, lora: dict[str, Any], init_adapter: str = "") -> TrainingSpec:
        """The trainer job of a Tinker model: its LoRA from ``lora_config``, the SDK's Adam, warm-started from
        ``init_adapter`` (a PEFT directory) when given."""
        path = self._base_path(base_model)
        rank = int(lora.get("rank", 32))
        attn, mlp = bool(lora.get("train_attn", True)), bool(lora.get("train_mlp", True))
        if not (attn or mlp):
            raise UserError("lora_config: train_attn or train_mlp must be true (lorarl adapts decoder linears)")
        targets = (ALL_LINEAR,) if attn and mlp else ATTENTION_TARGETS if attn else MLP_TARGETS
        try:
            # exports name the base as the client did (the front's model name), not this host's folder
            return TrainingSpec(base_model_path=path, base_model_name=base_model,
                                lora=LoraSpec(rank=rank, alpha=2 * rank, target_modules=targets),
                                loss=LossSpec(type="importance_sampling"),
                                optimizer=OptimizerSpec(beta2=TINKER_ADAM["beta2"], eps=TINKER_ADAM["eps"],
                                                        max_grad_norm=0.0),
                                seed=int(lora.get("seed") or 0), init_adapter_path=init_adapter)
        except ValueError as e:
            raise UserError(f"lora_config: {e}") from None

    def get_info(self, model_id: str, tenant: str = DEFAULT_TENANT) -> dict[str, Any]:
        model = self.model(model_id, tenant)
        return {"model_id": model_id, "is_lora": True, "lora_rank": model.rank, "model_name": model.base_model,
                "model_data": {"model_name": model.base_model,
                               "tokenizer_id": str(Path(self.base_models[model.base_model]).resolve())},
                "optimizer_config": {"type": "adamw"}, "type": "get_info"}

    async def _call(self, method: Any, request: Any) -> Any:
        """A gRPC call whose refusal (a bad argument, a missing job) is the caller's error, by its message."""
        try:
            return await method(request)
        except grpc.aio.AioRpcError as e:
            raise refusal(e) from None

    # ------------------------------------------------------------ training

    async def forward_backward(self, request: Any) -> bytes:
        model = self.model(request.model_id)
        records = wire.trajectories(request, model.job_id)
        clip = wire.loss_config(request)
        loss = LossSpec(type=wire.LOSSES[request.loss_fn], **clip)
        reply = await self._call(self._trainer_of(model.tenant).ForwardBackward, trainer_pb2.ForwardBackwardRequest(
            job_id=model.job_id, trajectories=records, loss=loss.to_proto(), forward_only=request.forward_only,
            return_logprobs=True))
        return wire.forward_backward_output([list(r.logprobs) for r in reply.logprobs], dict(reply.metrics.values))

    async def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self.model(str(body.get("model_id", "")))
        params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params") or {}
        if params.get("type", "adam") not in ("adam", "adamw"):
            raise UserError(f"optimizer {params.get('type')!r}: lorarl serves adam")
        lr = float(params.get("learning_rate", 1e-4))
        if not (math.isfinite(lr) and 0 < lr <= 10):
            raise UserError(f"adam_params.learning_rate must be in (0, 10], got {lr}")
        try:
            adam = AdamStep(**{name: float(params[key]) for key, name in ADAM_FIELDS.items()
                               if params.get(key) is not None})
            adam.applied_to(OptimizerSpec())  # OptimizerSpec's bounds, named: "optimizer.beta1 must be in [0, 1)"
        except (TypeError, ValueError) as e:
            raise UserError(f"adam_params: {e}") from None
        reply = await self._call(self._trainer_of(model.tenant).OptimStep, adam.to_proto(trainer_pb2.OptimStepRequest(
            job_id=model.job_id, learning_rate=lr)))
        model.version = int(reply.version)
        self._keep()
        metrics = {f"{k}:mean": float(v) for k, v in reply.metrics.values.items() if math.isfinite(v)}
        return {"metrics": metrics, "type": "optim_step"}

    # ------------------------------------------------------------ state

    async def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """save_state: adapter, Adam moments and RNG as a trainer checkpoint, named by a tinker:// path."""
        model = self.model(str(body.get("model_id", "")))
        name = str(body.get("path") or f"step-{model.version}")
        path = f"tinker://{model.model_id}/weights/{name}"
        expires_at = self._expires_at(body)
        if path in self.saved and not body.get("overwrite"):
            raise UserError(f"{path} exists; save under another name or pass overwrite")
        trainer = self._trainer_of(model.tenant)
        reply = await self._call(trainer.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest(
            job_id=model.job_id, path=f"{model.job_id}/{name}"))
        adapter = await self._call(trainer.Export, trainer_pb2.ExportRequest(
            job_id=model.job_id, mode=common_pb2.SYNC_MODE_ADAPTER, path=f"{model.job_id}/{name}-adapter"))
        self.saved[path] = Saved(reply.path, adapter.path, model.base_model, model.rank,
                                 self._lora_of.get(model.model_id, {}), tenant=model.tenant, expires_at=expires_at)
        self.runs.saved(path, expires_at)
        self._deleted.discard(path)
        self._keep()
        return {"path": path, "type": "save_weights"}

    def _expires_at(self, body: dict[str, Any]) -> float:
        """When a path saved by ``body`` expires (its ttl_seconds from now; 0: never)."""
        return self._expiry(body.get("ttl_seconds"))

    def _expiry(self, ttl: Any) -> float:
        if ttl is None:
            return 0.0
        low, high = TTL_RANGE_S
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not low <= ttl <= high:
            raise UserError(f"ttl_seconds must be an integer from {low} (1 hour) to {high} (10 years), or null "
                            f"(never expires); got {ttl!r}")
        return self._wall() + ttl

    def set_ttl(self, run_id: str, checkpoint_id: str, ttl: Any, tenant: str = DEFAULT_TENANT) -> None:
        """PUT .../checkpoints/{checkpoint_id}/ttl: the path expires ``ttl`` seconds from now (None: never)."""
        expires_at = self._expiry(ttl)
        path = self.runs.set_expiry(run_id, checkpoint_id, expires_at, tenant)
        if path in self.saved:
            self.saved[path] = replace(self.saved[path], expires_at=expires_at)
        if path in self._paths:  # shared by the sampling sessions on it
            self._paths[path].expires_at = expires_at
        self._keep()

    def _check_unexpired(self, path: str, record: Any) -> None:
        if record.expires_at and self._wall() >= record.expires_at:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.expires_at))
            raise UserError(f"{path} expired at {when} (its ttl_seconds)")

    def expire_paths(self) -> list[str]:
        """The saved paths whose ttl_seconds have passed: they no longer load, sample or list (the trainer's files
        stay until its own retention removes them). The paths expired."""
        now = self._wall()
        gone = [p for records in (self.saved, self._paths) for p, r in records.items()
                if r.expires_at and now >= r.expires_at]
        for path in gone:
            self.saved.pop(path, None)
            self._paths.pop(path, None)
            self._deleted.add(path)
            self.runs.drop(path)
            logger.info("%s: its ttl_seconds passed; expired", path)
        if gone:
            self._keep()
        return gone

    def delete_checkpoint(self, run_id: str, checkpoint_id: str, tenant: str = DEFAULT_TENANT) -> None:
        """DELETE .../checkpoints/{checkpoint_id}: the path no longer loads or samples (the trainer keeps its files
        until its own retention removes them)."""
        path = self.runs.forget(run_id, checkpoint_id, tenant)
        self.saved.pop(path, None)
        self._paths.pop(path, None)
        self._deleted.add(path)
        self._keep()

    def _saved(self, body: dict[str, Any], tenant: str) -> Saved:
        path = str(body.get("path", ""))
        if path not in self.saved or self.saved[path].tenant != tenant:
            raise UserError(f"no checkpoint at {path!r} (this front knows the save_state paths it returned)")
        self._check_unexpired(path, self.saved[path])
        return self.saved[path]

    async def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """load_state[_with_optimizer] on a model: with the optimizer, the checkpoint (Adam moments, step and
        RNG included); without, the model's job starts again from the saved adapter with a fresh optimizer."""
        model = self.model(str(body.get("model_id", "")))
        saved = self._saved(body, model.tenant)
        trainer = self._trainer_of(model.tenant)
        if body.get("optimizer", False):
            reply = await self._call(trainer.LoadCheckpoint, trainer_pb2.LoadCheckpointRequest(
                job_id=model.job_id, path=saved.checkpoint))
            model.version = int(reply.version)
            self._keep()
        else:
            session_id, seq = model.model_id.split(":train:")
            await self._call(trainer.DeleteJob, trainer_pb2.DeleteJobRequest(job_id=model.job_id))
            del self.models[model.model_id]
            self.sessions.get(session_id, set()).discard(model.model_id)
            await self.create_model({"session_id": session_id, "model_seq_id": int(seq),
                                     "base_model": saved.base_model, "lora_config": saved.lora or {"rank": saved.rank}},
                                    init_adapter=saved.adapter, tenant=model.tenant)
        return {"path": body["path"], "type": "load_weights"}

    async def create_from_state(self, body: dict[str, Any], tenant: str = DEFAULT_TENANT) -> dict[str, Any]:
        """create_training_client_from_state[_with_optimizer]: a new model like the saved one, from its state."""
        saved = self._saved(body, tenant)
        with_optimizer = bool(body.get("optimizer", False))
        created = await self.create_model({"session_id": body.get("session_id"), "model_seq_id":
                                           body.get("model_seq_id", 0), "base_model": saved.base_model,
                                           "lora_config": saved.lora or {"rank": saved.rank}},
                                          init_adapter="" if with_optimizer else saved.adapter, tenant=tenant)
        if with_optimizer:
            await self.load_weights({**body, "model_id": created["model_id"]})
        return {"model_id": created["model_id"], "path": body["path"], "type": "load_weights"}

    # ------------------------------------------------------------ sampling

    def _new_sampler(self, sampler: Sampler, tenant: str) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"  # unique across restarts of the front
        self.samplers[sampler_id] = sampler
        self.sampler_owner[sampler_id] = tenant
        self._keep()
        return sampler_id

    async def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self.model(str(body.get("model_id", "")))
        if body.get("kind", "snapshot") != "snapshot":
            raise UserError(f"kind={body['kind']!r}: only snapshot samplers are served (fixed weights per version)")
        if self.rollout is None:
            raise UserError("this front has no rollout to sample from (start it with one)")
        name = body.get("path")
        expires_at = self._expires_at(body)
        if model.version == 0:  # untrained: a fresh adapter (B = 0) computes what the base does; nothing to publish
            path = f"tinker://{model.model_id}/sampler_weights/{name or 'v0'}"
            return self._saved_sampler(Sampler(model.base_model, "", 0, path, tenant=model.tenant,
                                               expires_at=expires_at))
        self._hold_slot(model.tenant, model.job_id)
        trainer = self._trainer_of(model.tenant)
        reply = await self._call(trainer.PublishWeights, trainer_pb2.PublishWeightsRequest(
            job_id=model.job_id, mode=common_pb2.SYNC_MODE_ADAPTER, wait_for_activation=True, timeout_seconds=600,
            skip_unpublished=True))  # a client saves after any number of optim steps
        if not reply.activated:
            raise UserError(f"the rollout did not take version {reply.version}: {reply.error or 'no reason given'}")
        path = f"tinker://{model.model_id}/sampler_weights/{name or f'v{reply.version}'}"
        # the same weights as a PEFT adapter: the rollout keeps only a job's last few versions (and none once its
        # session ends), so a path sampled after that is restored from this (`_restore`)
        exported = await self._call(trainer.Export, trainer_pb2.ExportRequest(
            job_id=model.job_id, mode=common_pb2.SYNC_MODE_ADAPTER, path=f"{model.job_id}/sampler-v{reply.version}"))
        return self._saved_sampler(Sampler(model.base_model, model.job_id, int(reply.version), path, exported.path,
                                           self._lora_of.get(model.model_id, {"rank": model.rank}),
                                           tenant=model.tenant, expires_at=expires_at))

    def _hold_slot(self, tenant: str, job_id: str) -> None:
        """``job_id``'s weights to be held on the rollout for ``tenant``: refused past its max_sampling_models
        (a job already there holds its slot)."""
        if job_id in self.on_rollout:
            return
        limit = self.tenants[tenant].limits.max_sampling_models
        held = sorted(j for j, t in self.on_rollout.items() if t == tenant)
        if len(held) >= limit:
            raise UserError(f"tenant {tenant!r} has {len(held)} models loaded on the rollout for sampling ({held}), "
                            f"its limit (tinker.tenants[].max_sampling_models {limit}): finish a session to free one")
        self.on_rollout[job_id] = tenant
        self._keep()

    def _saved_sampler(self, sampler: Sampler) -> dict[str, Any]:
        """A sampler path saved: known by path (kept across a restart), a sampling session on it."""
        self._paths[sampler.model_path] = sampler
        self.runs.saved(sampler.model_path, sampler.expires_at)
        self._deleted.discard(sampler.model_path)
        # _new_sampler writes the state file, this path with it
        return {"path": sampler.model_path, "sampling_session_id": self._new_sampler(sampler, sampler.tenant),
                "type": "save_weights_for_sampler"}

    def _keep(self) -> None:
        """The state file rewritten (lorarl.tinker.state): called on each change of what it holds."""
        sampling = {sampler_id: {"owner": self.sampler_owner[sampler_id],
                                 **({"path": s.model_path} if s.model_path in self._paths else
                                    {"base_model": s.base_model})}
                    for sampler_id, s in self.samplers.items()}
        self.state.write(Snapshot(
            saved=self.saved, paths=self._paths, deleted=self._deleted, sessions=self.session_owner,
            models=self.models, lora=self._lora_of, sampling=sampling, runs=self.runs.runs,
            restored={r: s.model_path for r, s in self._restored.items()}, on_rollout=self.on_rollout))

    def create_sampling_session(self, body: dict[str, Any], tenant: str = DEFAULT_TENANT) -> dict[str, Any]:
        self._session(str(body.get("session_id", "")), tenant)
        if body.get("model_path"):
            found = self._paths.get(body["model_path"])
            if found is None or found.tenant != tenant:  # another tenant's path is not there for this one
                raise UserError(f"no sampler weights at {body['model_path']!r}")
            if body["model_path"] in self._deleted:
                raise UserError(f"{body['model_path']} was deleted")
            self._check_unexpired(body["model_path"], found)
            return {"sampling_session_id": self._new_sampler(found, tenant)}
        base_model = str(body.get("base_model", ""))
        self._base_path(base_model)
        return {"sampling_session_id": self._new_sampler(Sampler(base_model, tenant=tenant), tenant)}

    def sampler(self, sampler_id: str, tenant: str) -> Sampler:
        if sampler_id not in self.samplers or self.sampler_owner.get(sampler_id) != tenant:
            raise UserError(f"unknown sampling_session_id {sampler_id!r}")
        return self.samplers[sampler_id]

    def sampler_info(self, sampler_id: str, tenant: str = DEFAULT_TENANT) -> dict[str, Any]:
        if sampler_id not in self.samplers or self.sampler_owner.get(sampler_id) != tenant:
            raise UserError(f"unknown sampler {sampler_id!r}")
        s = self.samplers[sampler_id]
        return {"sampler_id": sampler_id, "base_model": s.base_model, **({"model_path": s.model_path}
                                                                         if s.model_path else {})}

    def sample_request(self, body: dict[str, Any], tenant: str = DEFAULT_TENANT
                       ) -> tuple[rollout_pb2.GenerateRequest, int, SampleShape]:
        """The rollout request for an asample body (checked before its future exists), num_samples, and what
        the response holds beside the samples."""
        sampler = self.sampler(str(body.get("sampling_session_id", "")), tenant)
        if self.rollout is None:
            raise UserError("this front has no rollout to sample from")
        if body.get("prompt_alt_tokens_k"):
            raise UserError("prompt_alt_tokens_k: not served (lorarl returns logprobs, not alternative draws)")
        topk = {}
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            value = body.get(key) or 0
            if not isinstance(value, int) or not 0 <= value <= MAX_TOPK:
                raise UserError(f"{key} must be an integer 0..{MAX_TOPK}, got {value!r}")
            topk[key] = value
        if body.get("record_stability_info"):
            raise UserError("record_stability_info: not served (no StableReinforce records are kept)")
        if body.get("target_prompt_logprobs"):
            raise UserError("target_prompt_logprobs: not served (lorarl returns the prompt's own logprobs)")
        n = int(body.get("num_samples", 1))
        if not 1 <= n <= 256:
            raise UserError(f"num_samples must be 1..256, got {n}")
        chunks = (body.get("prompt") or {}).get("chunks") or []
        tokens: list[int] = []
        for i, chunk in enumerate(chunks):
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"prompt.chunks[{i}]: only encoded_text chunks are served")
            tokens.extend(int(t) for t in chunk.get("tokens", []))
        if not tokens:
            raise UserError("prompt has no tokens")
        p = body.get("sampling_params") or {}
        params = common_pb2.SamplingParams(n=n, temperature=float(p.get("temperature", 1.0)),
                                           top_p=float(p.get("top_p", 1.0)), top_k=int(p.get("top_k", -1)),
                                           max_tokens=int(p.get("max_tokens") or 0))
        if p.get("seed") is not None:
            params.seed = int(p["seed"])
        params.prompt_logprobs = bool(body.get("prompt_logprobs")) or topk["topk_prompt_logprobs"] > 0
        params.logprobs = max(topk.values())
        stop = p.get("stop")
        if isinstance(stop, str):
            params.stop.append(stop)
        elif isinstance(stop, list):
            for item in stop:
                (params.stop_token_ids if isinstance(item, int) else params.stop).append(item)
        policy = rollout_pb2.PolicySelector(job_id=sampler.job_id, version=sampler.version)
        last_n = body.get("prompt_logprobs_last_n")
        shape = SampleShape(None if last_n is None else int(last_n), topk["topk_prompt_logprobs"],
                            topk["topk_sample_logprobs"])
        return rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=tokens)], sampling=params,
                                           policy=policy), n, shape

    async def _restore(self, sampler: Sampler, job_id: str, version: int) -> None:
        """Serves ``sampler``'s weights again after the rollout let its version go (a job keeps its last few
        versions loaded; a finished session's none): a trainer job warm-started from the adapter exported when
        the path was saved, published once, and the sampler (every session on that path) moved to it. At most
        MAX_RESTORED at once: the oldest restore leaves the trainer and the rollout. Called for the version that
        was not found (``job_id`` v``version``): a second caller that waited on the lock finds it moved on."""
        if self._restore_lock is None:
            self._restore_lock = asyncio.Lock()
        async with self._restore_lock:
            if (sampler.job_id, sampler.version) != (job_id, version):
                return
            owner = self.tenants[sampler.tenant]
            restore_id = f"{owner.job_prefix}restored-{uuid.uuid4().hex[:10]}"  # unique across restarts of the front
            mine = [r for r, s in self._restored.items() if s.tenant == owner.name]
            if mine and sum(t == owner.name for t in self.on_rollout.values()) >= owner.limits.max_sampling_models:
                await self._drop_restored(mine[0])  # the tenant's own oldest restore makes room, before a refusal
            self._hold_slot(owner.name, restore_id)
            spec = self._spec(sampler.base_model, sampler.lora or {}, init_adapter=sampler.adapter)
            trainer = self._trainer_of(owner.name)
            try:
                await self._call(trainer.CreateJob, trainer_pb2.CreateJobRequest(job_id=restore_id,
                                                                                  config=spec.to_proto()))
            except BaseException:
                self.on_rollout.pop(restore_id, None)
                raise
            reply = await self._call(trainer.PublishWeights, trainer_pb2.PublishWeightsRequest(
                job_id=restore_id, mode=common_pb2.SYNC_MODE_ADAPTER, wait_for_activation=True, timeout_seconds=600))
            if not reply.activated:
                raise UserError(f"{sampler.model_path}: the rollout did not take its restored weights: "
                                f"{reply.error or 'no reason given'}")
            logger.info("%s: %s v%d was no longer loaded; restored from %s as %s v%d", sampler.model_path, job_id,
                        version, sampler.adapter, restore_id, reply.version)
            sampler.job_id, sampler.version = restore_id, int(reply.version)
            self._restored[restore_id] = sampler
            self._keep()
            while len(self._restored) > MAX_RESTORED:
                await self._drop_restored(next(iter(self._restored)))

    async def _drop_restored(self, restore_id: str) -> None:
        """A restore off the trainer and the rollout; its sampler is restored again if sampled again."""
        sampler = self._restored.pop(restore_id, None)
        self._keep()
        try:
            await self._trainer_of(sampler.tenant if sampler else DEFAULT_TENANT).DeleteJob(
                trainer_pb2.DeleteJobRequest(job_id=restore_id))
        except grpc.aio.AioRpcError as e:
            logger.warning("could not delete restore job %s: %s", restore_id, e.details())
        await self._unload(restore_id)

    async def sample(self, request: rollout_pb2.GenerateRequest, shape: SampleShape | None = None,
                     sampler: Sampler | None = None) -> bytes:
        """One sample call; a ``sampler`` whose version the rollout no longer holds is restored and asked again."""
        shape = shape or SampleShape()
        try:
            reply = await self.rollout.Generate(request)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND or sampler is None or not sampler.adapter:
                raise refusal(e) from None
            await self._restore(sampler, request.policy.job_id, request.policy.version)
            request.policy.CopyFrom(rollout_pb2.PolicySelector(job_id=sampler.job_id, version=sampler.version))
            reply = await self._call(self.rollout.Generate, request)
        (result,) = reply.results
        prompt = list(result.prompt_logprobs) if request.sampling.prompt_logprobs else None
        tops: list[Any] | None = None
        if prompt is not None:
            tops = [None, *list(result.prompt_top_logprobs)[1:]] if result.prompt_top_logprobs else None
            unscored = max(0, len(prompt) - shape.last_n) if shape.last_n is not None else 0
            prompt = [math.nan] * unscored + prompt[unscored:]  # the SDK wants NaN before the last n
            if tops is not None:
                tops = [None] * unscored + tops[unscored:]
        return wire.sample_response(result.completions, prompt, tops, shape.topk_prompt, shape.topk_sample)
