"""A job file's services and the Tinker front (lorarl.tinker) over them, on this machine: what
`lorarl tinker JOB` runs, and what tests and examples start.

    lorarl tinker examples/demo.yaml       # prints TINKER_BASE_URL and TINKER_API_KEY, serves until Ctrl-C

The job file says the model (served to clients as ``model.path``'s folder name, and under its path) and how
the services run (rollout engine, LoRA slots); its own loop, data and reward are not used: the Tinker
client brings those. The rollout is one that several jobs share (rollout.shared): it serves adapters up to
the larger of the job file's rank and the SDK's default (32), and a client asking for more is refused at
create_lora_training_client, naming the limit and rollout.max_lora_rank, never merged over the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Front:
    base_url: str
    api_key: str
    base_model: str  # the name a client passes as base_model
    trainer: str
    rollout: str


def model_names(model_path: str) -> dict[str, str]:
    """The names a job's model is served under: its folder's name and its path as written."""
    resolved = str(Path(model_path).resolve())
    return {Path(model_path).name: resolved, model_path: resolved}


@contextlib.contextmanager
def serve_front(models: dict[str, str], trainer: str, rollout: str, token: str | None, api_key: str,
                host: str = "127.0.0.1", session_ttl_s: float | None = None,
                state_path: str | Path | None = None, other_tenants: Sequence[Any] = ()) -> Iterator[str]:
    """The front on a thread of its own (its own event loop), until the block ends; yields its base URL.
    ``session_ttl_s``: silence after which a session expires (None: the service's default); ``state_path``: where
    the front's state and request journal are kept across restarts (None: memory); ``other_tenants``:
    FrontTenants served beside the default one, whose key is ``api_key`` (lorarl.tinker.tenants)."""
    from lorarl.common.http_server import start_http_server
    from lorarl.tinker.app import create_app
    from lorarl.tinker.service import TinkerService
    from lorarl.tinker.tenants import DEFAULT_TENANT, FrontTenant, FrontTenants

    started: Future = Future()

    def run() -> None:
        async def main() -> None:
            ttl = {} if session_ttl_s is None else {"session_ttl_s": session_ttl_s}
            app = create_app(TinkerService(models, trainer, rollout, token=token, state_path=state_path,
                                           tenants=FrontTenants([FrontTenant(DEFAULT_TENANT, (api_key,)),
                                                                 *other_tenants]), **ttl))
            try:
                web = await start_http_server(app, host, 0, name="Tinker API", lifespan="on")
            except BaseException as e:
                started.set_exception(e)
                return
            started.set_result(web)
            await web.wait()

        asyncio.run(main())

    thread = threading.Thread(target=run, name="tinker-front", daemon=True)
    thread.start()
    web: Any = started.result(60)
    try:
        yield web.url
    finally:
        web.request_stop()
        thread.join(30)


@contextlib.contextmanager
def local_front(config: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None,
                other_tenants: Sequence[Any] = ()) -> Iterator[Front]:
    """The job file's three services (as `lorarl run` starts them) and the front over them: its generated key the
    default tenant's, ``other_tenants`` (lorarl.tinker.tenants.FrontTenant) beside it."""
    from lorarl.client.job.config import base_model_name, load_job_config
    from lorarl.client.launch.many_jobs import shared_sections
    from lorarl.client.launch.services import local_stack
    from lorarl.contract.sharing import TINKER_SDK_DEFAULT_RANK

    cfg = load_job_config(str(config), list(overrides))
    out = Path(out or cfg.output.dir)
    # Many clients' jobs on one rollout: sized and marked as a shared one, serving the SDK's default rank.
    stack = local_stack(cfg, out, sections=shared_sections([cfg], out, min_rank=TINKER_SDK_DEFAULT_RANK))
    api_key = f"tml-{secrets.token_urlsafe(24)}"
    with stack:
        trainer, rollout = stack.address("trainer"), stack.addresses("rollout")[0]
        # also under the name the job gave its base (a Hub id): the name the clients' exported adapters then record
        models = {**model_names(cfg.model.path), base_model_name(cfg): str(Path(cfg.model.path).resolve())}
        with serve_front(models, trainer, rollout, stack.token, api_key,
                         state_path=out / "tinker-state.json", other_tenants=other_tenants) as base_url:
            yield Front(base_url, api_key, Path(cfg.model.path).name, trainer, rollout)
