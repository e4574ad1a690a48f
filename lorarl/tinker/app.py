"""The Tinker API's HTTP routes (`/api/v1/...`) over a TinkerService: thin handlers, the wire rules of
docs/tinker_protocol.md section 0 kept here — the API key in ``X-API-Key``, futures for the calls the SDK
awaits, protobuf in and out where it sends or expects it, a failed request as a settled future (HTTP 200
``{"error", "category"}``), and every refusal a 4xx with a body: a 5xx (or 408/409/429) is retried by the SDK
for minutes, so none is sent for a caller's mistake or an unknown route (404)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from tinker.proto import tinker_public_pb2 as pb

from lorarl.tinker.bodies import checked
from lorarl.tinker.futures import Futures, Outcome, UserError
from lorarl.tinker.runs import MAX_PAGE, NotFoundError
from lorarl.tinker.service import TinkerService
from lorarl.tinker.state import Journal
from lorarl.tinker.tenants import RETRY_AFTER_S, Admission, TooManyRequestsError

logger = logging.getLogger(__name__)
PROTOBUF = "application/x-protobuf"
#: The routes that name no tenant's resource; every other route acts as the caller's tenant (``caller``).
UNOWNED_ROUTES = frozenset({"GET /api/v1/healthz", "POST /api/v1/client/config", "GET /api/v1/get_server_capabilities",
                            "POST /api/v1/telemetry", "POST /api/v1/create_session"})


def create_app(service: TinkerService, futures: Futures | None = None) -> FastAPI:
    """The front's app: the keys accepted in X-API-Key are its tenants' (``service.tenants``; each starts with
    "tml-", as the SDK requires of a key). Each request acts as the tenant whose key it presents: it sees only
    that tenant's sessions, models, samplers, paths, runs and futures, and waits in that tenant's queue."""
    tenants = service.tenants
    if not any(t.keys for t in tenants.by_name.values()):
        raise ValueError("the Tinker front needs API keys, each starting with 'tml-' (the SDK refuses others)")
    if futures is None:  # each request journaled beside the state file, read back after a restart
        futures = Futures(journal=Journal(service.state.journal_path))
        futures.restore()
    for model_id in service.models:  # models a killed front held: their requests go on in seq_id order
        futures.start_model(model_id)
    admission = Admission(tenants)
    app = FastAPI(title="lorarl Tinker front")
    app.state.service, app.state.futures, app.state.admission = service, futures, admission

    def model_ended(model_id: str) -> None:
        """Requests of an ended model that wait for an earlier seq_id fail, and leave their tenant's queue."""
        for owner in futures.end_model(model_id, f"model {model_id!r} ended (its session finished) before this "
                                                 f"request's earlier seq_ids arrived: create a new model to go on"):
            admission.withdraw(owner)

    service.on_model_ended = model_ended

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        tenant = tenants.of_key(request.headers.get("x-api-key", ""))
        if request.url.path != "/api/v1/healthz" and tenant is None:
            logger.warning("tinker: refused %s %s: bad or missing X-API-Key", request.method, request.url.path)
            return JSONResponse({"detail": "a valid X-API-Key is needed"}, status_code=401)
        request.state.tenant = tenant.name if tenant is not None else ""
        return await call_next(request)

    @app.exception_handler(TooManyRequestsError)
    async def too_many(request: Request, exc: TooManyRequestsError) -> JSONResponse:
        logger.warning("tinker: refused %s: %s", request.url.path, exc)
        return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(NotFoundError)
    async def not_found(request: Request, exc: NotFoundError) -> JSONResponse:
        logger.info("tinker: not found %s: %s", request.url.path, exc)
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        logger.info("tinker: refused %s: %s", request.url.path, exc)
        return JSONResponse({"detail": str(exc)}, status_code=400)

    async def body_of(request: Request) -> dict[str, Any]:
        """The JSON body, validated by the SDK's model of its route (lorarl.tinker.bodies): 400 naming a bad field."""
        try:
            data = await request.json()
        except ValueError:
            raise UserError("the body must be a JSON object") from None
        if not isinstance(data, dict):
            raise UserError("the body must be a JSON object")
        return checked(request.url.path.rsplit("/", 1)[-1], data)

    def future(request_id: str, **extra: Any) -> dict[str, Any]:
        return {"request_id": request_id, **extra}

    def caller(request: Request) -> str:
        """The tenant the request acts as (its key's)."""
        return request.state.tenant

    def new_model(request: Request, body: dict[str, Any],
                  create: Callable[[dict[str, Any], str], Awaitable[Any]]) -> dict[str, Any]:
        """The future of `create(body, tenant)`, the model's first request: its ordered requests start after it."""
        tenant = caller(request)
        seq = body.get("model_seq_id", 0)
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise UserError(f"model_seq_id must be an integer, got {seq!r}")
        model_id = service.model_id_for(str(body.get("session_id", "")), seq)

        async def work() -> Any:
            created = await create(body, tenant)
            futures.start_model(model_id)
            return created

        return future(futures.submit(admission.admitted(tenant, work), tenant), model_id=model_id)

    def in_model_order(request: Request, model_id: str, seq_id: Any,
                       call: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
        """The future of `call()` on the caller's model ``model_id``, run after the model's earlier seq_ids."""
        tenant = caller(request)
        service.model(model_id, tenant)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise UserError(f"seq_id must be an integer, got {seq_id!r}")
        if (again := futures.resubmitted(model_id, seq_id, tenant)) is not None:
            return future(again, model_id=model_id)
        work = admission.admitted(tenant, call)
        try:
            request_id = futures.submit_ordered(model_id, seq_id, work, tenant)
        except BaseException:
            admission.withdraw(tenant)
            raise
        return future(request_id, model_id=model_id)

    def ordered(request: Request, body: dict[str, Any],
                call: Callable[[dict[str, Any]], Awaitable[Any]]) -> dict[str, Any]:
        return in_model_order(request, str(body.get("model_id", "")), body.get("seq_id", 0), lambda: call(body))

    # ------------------------------------------------------------ bootstrap and sessions

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        # Chunks of one forward_backward arrive one by one: each model's order is kept anyway (futures.py).
        return {"parallel_fwdbwd_chunks": False, "fwdbwd_max_chunk_len": 4096}

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return service.capabilities()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        await body_of(request)
        return service.create_session(caller(request))

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        if not service.heartbeat(str(body.get("session_id", "")), caller(request)):  # unknown, ended, another's
            return JSONResponse({"detail": "unknown session"}, status_code=410)  # the SDK stops heartbeating
        return {}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        await service.finish_session(session_id, caller(request))  # another tenant's session: left alone
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    # ------------------------------------------------------------ training

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        return new_model(request, await body_of(request),
                         lambda body, tenant: service.create_model(body, tenant=tenant))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return service.get_info(str((await body_of(request)).get("model_id", "")), caller(request))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise UserError(f"forward_backward takes a protobuf ForwardBackwardRequest ({PROTOBUF})")
        message = pb.ForwardBackwardRequest()
        try:
            message.ParseFromString(await request.body())
        except Exception:
            raise UserError("the body is not a ForwardBackwardRequest") from None
        return in_model_order(request, message.model_id, message.seq_id, lambda: service.forward_backward(message))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return ordered(request, await body_of(request), service.optim_step)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return ordered(request, await body_of(request), service.save_weights_for_sampler)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return ordered(request, await body_of(request), service.save_weights)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        if "model_id" in body:  # load_state_with_optimizer on an existing model, in its order
            return ordered(request, body, service.load_weights)
        return new_model(request, body,  # a new model from a checkpoint
                         lambda body, tenant: service.create_from_state(body, tenant=tenant))

    # ------------------------------------------------------------ sampling

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        return service.create_sampling_session(await body_of(request), caller(request))

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        return service.sampler_info(sampler_id, caller(request))

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        tenant = caller(request)
        generate, n, shape = service.sample_request(body, tenant)
        sampler = service.sampler(str(body.get("sampling_session_id", "")), tenant)
        request_id = futures.submit(admission.admitted(tenant, lambda: service.sample(generate, shape, sampler)),
                                    tenant)
        return future(request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(n)])

    # ------------------------------------------------------------ REST: training runs and checkpoints

    def page(limit: int, offset: int) -> tuple[int, int]:
        if not 1 <= limit <= MAX_PAGE or offset < 0:
            raise UserError(f"limit must be 1..{MAX_PAGE} and offset >= 0, got limit {limit}, offset {offset}")
        return limit, offset

    @app.get("/api/v1/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return service.runs.training_runs(*page(limit, offset), owner=caller(request))

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request) -> dict[str, Any]:
        return service.runs.training_run(run_id, owner=caller(request))

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        return service.runs.checkpoints(run_id, owner=caller(request))

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        service.delete_checkpoint(run_id, checkpoint_id, caller(request))
        return {}

    @app.put("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def checkpoint_ttl(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        service.set_ttl(run_id, checkpoint_id, (await body_of(request))["ttl_seconds"], caller(request))
        return {}

    @app.get("/api/v1/checkpoints")
    async def user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return service.runs.checkpoints(None, *page(limit, offset), owner=caller(request))

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        return service.runs.weights_info((await body_of(request))["tinker_path"], owner=caller(request))

    # ------------------------------------------------------------ futures

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        request_id = str((await body_of(request)).get("request_id", ""))
        try:
            outcome: Outcome | None = await futures.retrieve(request_id, caller(request))
        except KeyError:
            raise HTTPException(404, f"unknown request_id {request_id!r}") from None
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if outcome.error:
            return JSONResponse({"error": outcome.error, "category": outcome.category})
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTOBUF)
        return JSONResponse(outcome.json)

    async def expire_sessions() -> None:
        """Sessions whose client went silent (crashed, killed, cut off) are finished, freeing what they hold;
        saved paths whose ttl_seconds passed expire."""
        while True:
            await asyncio.sleep(min(30.0, max(0.1, service.session_ttl_s / 4)))
            try:
                await service.expire_silent()
                service.expire_paths()
            except Exception:
                logger.exception("tinker: expiring silent sessions or saved paths failed")

    @app.on_event("startup")
    async def startup() -> None:
        await service.reconcile()  # kept models whose trainer jobs are gone: dropped, not answered as missing jobs
        app.state.expiry = asyncio.create_task(expire_sessions(), name="tinker-session-expiry")

    @app.on_event("shutdown")
    async def shutdown() -> None:
        app.state.expiry.cancel()
        await futures.close()
        await service.close()

    return app
