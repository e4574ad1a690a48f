"""One lorarl service on one Ray node: the body of the actor the Ray launcher places there.

The actor starts `lorarl serve SERVICE` exactly as `lorarl run` does on one host (a LocalStack of one
process, bound to the node's own address, restarted when it exits), and hands the driver what it needs:
the address, the node, and the log as it grows. The service process watches the actor
(lorarl.common.parent_watch), so a killed actor or a lost driver leaves nothing running. Ray is not
imported at module level: the driver wraps this class with ``ray.remote``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lorarl.client.launch.local import LocalStack
from lorarl.client.launch.log_files import LogRetention, read_since

LOG_CHUNK_BYTES = 1 << 20


class ServiceHost:
    def __init__(self, name: str, service: str, section: dict[str, Any], token: str, workdir: str,
                 threads: int = 1, env: dict[str, str] | None = None,
                 log_retention: tuple[int, int] | None = None, metrics: bool = False,
                 metrics_host: str = "127.0.0.1") -> None:
        """``metrics``, ``metrics_host``: output.prometheus and output.prometheus_host (LocalStack's)."""
        import ray

        from lorarl.common.parent_watch import mark

        mark()  # the service exits when this actor's process does
        self.name, self.service = name, service
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = ray.util.get_node_ip_address()
        self.stack = LocalStack(Path(workdir), {service: section}, token=token, services=(service,), host=self.host,
                                threads_per_service=threads, process_env={service: dict(env or {})},
                                log_retention=LogRetention(*log_retention) if log_retention else LogRetention(),
                                metrics=metrics, metrics_host=metrics_host)

    def start(self) -> dict[str, Any]:
        """Starts the service; where it serves and on which node (RuntimeError with its log tail if it did not)."""
        self.stack.start()
        svc = self.stack.processes[self.service]
        return {"name": self.name, "service": self.service, "address": svc.address, "node_id": self.node_id,
                "node_ip": self.host, "pid": svc.process.pid, "info": svc.info,
                "devices": {k: v for k, v in os.environ.items() if k.endswith("_VISIBLE_DEVICES")}}

    def supervise(self, restarts: int) -> None:
        self.stack.supervise(restarts)

    def poll(self, generation: int, offset: int) -> tuple[bytes, int, int, str | None, int | None]:
        """(log bytes from where the driver stands, where it stands next: (generation, offset) across the log's
        rotations (log_files.read_since), why it failed for good or None, its current pid)."""
        svc = self.stack.processes.get(self.service)
        log = self.stack.workdir / f"{self.service}.log"
        current = self.stack.log_rotator.generations.get(log, 0)
        chunk, generation, offset = read_since(log, generation, offset, current,
                                               self.stack.log_retention.backups, LOG_CHUNK_BYTES)
        failure = str(self.stack.failure) if self.stack.failure is not None else None
        return chunk, generation, offset, failure, svc.process.pid if svc is not None else None

    def stop(self) -> None:
        self.stack.stop()
