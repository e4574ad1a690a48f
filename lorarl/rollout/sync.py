"""Connects a rollout replica to the weight-sync service: subscribe, stage, commit, report.

The agent runs on its own event loop in a daemon thread (AgentThread) and reaches the rollout core
through RolloutSink, which runs each call on the service's loop. Capabilities come from the engine,
so weight sync can choose adapter or merged mode for each job on its own.
"""

from __future__ import annotations

import asyncio
import logging

from lorarl.common.channel import ClientTls
from lorarl.platform.shared_memory import colocation_id
from lorarl.rollout.core import RolloutCore
from lorarl.rollout.sink import RolloutSink
from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.client.agent import AgentThread, WeightSyncAgent
from lorarl.weightsync.wire.net import local_address_towards

logger = logging.getLogger(__name__)

BACKENDS = {"gloo": common_pb2.COLLECTIVE_BACKEND_GLOO, "nccl": common_pb2.COLLECTIVE_BACKEND_NCCL,
            "hccl": common_pb2.COLLECTIVE_BACKEND_HCCL}


def replica_capabilities(core: RolloutCore, backends: list[str]) -> weightsync_pb2.ReplicaCapabilities:
    info = core.info
    return weightsync_pb2.ReplicaCapabilities(
        supports_lora=info.supports_lora, max_lora_rank=info.max_lora_rank if info.supports_lora else 0,
        max_loras=info.max_loras if info.supports_lora else 0, base_model_fingerprint=core.fingerprint,
        engine=info.engine, collective_backends=[BACKENDS[b] for b in backends],
        receiving_ranks=receiving_ranks(core), shared=bool(core.settings.base_write_refusal()),
        colocation_id=colocation_id(core.settings.shared_base) if core.settings.shared_base else "")


def receiving_ranks(core: RolloutCore) -> int:
    """One rank per engine worker where the engine receives in its workers (contract/transfer_ranks.py)."""
    engine = core.engine
    return int(getattr(engine, "worker_count", 1)) if getattr(engine, "receives_in_worker", False) else 1


def start_sync_agent(core: RolloutCore, *, target: str, replica_id: str, token: str | None, backends: list[str],
                     host: str | None = None, device: str = "cpu", wait_s: float = 30.0,
                     tls: ClientTls | None = None, serve_address: str = "") -> AgentThread:
    """Subscribes this replica to every job weight sync knows (job_ids empty) and keeps it in sync."""
    sink = RolloutSink(core, asyncio.get_running_loop())
    agent = WeightSyncAgent(target, sink, replica_id=replica_id, capabilities=replica_capabilities(core, backends),
                            token=token, host=host or None, device=device, tls=tls,
                            serve_address=serve_address)
    thread = AgentThread(agent)
    thread.start()  # subscription is awaited by wait_connected without blocking the service's loop
    return thread


def advertised_address(advertise: str, bind_host: str, port: int, weightsync: str) -> str:
    """host:port clients reach this replica at: rollout.advertise_address (a host alone takes the bound
    port), else the bound host, else (bound to every interface) the local address of the route to weight
    sync, the interface the rest of the job sees this host by."""
    if advertise:
        return advertise if advertise.rpartition(":")[2].isdigit() and not advertise.endswith("]") \
            else f"{advertise}:{port}"
    host = bind_host if bind_host not in ("0.0.0.0", "::", "") else local_address_towards(weightsync)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def wait_connected(thread: AgentThread, timeout_s: float) -> None:
    ok = await asyncio.to_thread(thread.agent.wait_connected, timeout_s)
    if not ok:
        raise TimeoutError(f"rollout replica did not subscribe to weight sync within {timeout_s:.0f} s")
