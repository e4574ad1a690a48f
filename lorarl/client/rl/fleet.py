"""The rollout replicas a job can use, as weight sync knows them.

Every replica subscribes to weight sync with the address it serves Generate at (rollout
advertise_address), so weight sync, the authority on versions, is also the one list of who serves:
a replica started anywhere (another `lorarl serve rollout`, a Ray actor, a scaled Kubernetes
StatefulSet, an srun task) joins a running job by subscribing, and leaves when its stream drops.
"""

from __future__ import annotations

import logging

from lorarl.client.calls import ServiceCallError
from lorarl.client.rl.rollout_pool import Discover, Fleet, FleetReplica
from lorarl.v1 import weightsync_pb2

logger = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 10.0


def weightsync_fleet(weightsync, job_id: str) -> Discover:
    """A ``discover()`` for RolloutPool: the connected replicas that advertise an address, with their versions
    of ``job_id`` (all at 0 until the job's first publish registers it; None while weight sync cannot answer)."""

    async def discover() -> Fleet | None:
        try:
            reply = await weightsync.GetSyncStatus(weightsync_pb2.GetSyncStatusRequest(), timeout=STATUS_TIMEOUT_S)
        except ServiceCallError as e:
            logger.debug("fleet not read: %s", e)
            return None
        job = next((j for j in reply.jobs if j.job_id == job_id), None)
        versions = {r.replica_id: r.active_version for r in job.replicas} if job is not None else {}
        return Fleet(job.active_version if job is not None else 0,
                     tuple(FleetReplica(r.replica_id, r.serve_address, versions.get(r.replica_id, 0))
                           for r in reply.fleet if r.connected and r.serve_address))

    return discover
