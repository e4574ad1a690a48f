"""A three-node Ray cluster on loopback for the launcher's tests, in a process of its own.

Ray's own multi-node test utility (ray.cluster_utils.Cluster) starts a head and two worker nodes on
this host, each a raylet of its own with its own custom resource, so where the launcher put each
service is observable: ``lorarl_head`` on the head, ``rollout_slot`` (1 each) and ``workerN`` on the
workers. Every Ray listener binds 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray from
dialling this host's external address). Run as a script: prints the address, then holds the cluster
until its standard input closes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DISABLE_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
NODE = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 * 1024 * 1024}


@dataclass
class RayCluster:
    address: str
    process: subprocess.Popen
    started_s: float


@contextlib.contextmanager
def ray_cluster(workers: int = 2, head_cpus: int = 2, timeout_s: float = 120) -> Iterator[RayCluster]:
    begun = time.monotonic()
    process = subprocess.Popen([sys.executable, __file__, str(workers), str(head_cpus)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **RAY_ENV}, start_new_session=True)
    try:
        address, lines = "", []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process.poll() is None:
            line = process.stdout.readline()
            lines.append(line)
            if line.startswith("RAY_ADDRESS="):
                address = line.split("=", 1)[1].strip()
                break
        assert address, "".join(lines)[-3000:]
        yield RayCluster(address, process, time.monotonic() - begun)
    finally:
        with contextlib.suppress(Exception):
            process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait(timeout=10)


def main(workers: int, head_cpus: int) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": head_cpus, "include_dashboard": False,
                                                             "resources": {"lorarl_head": 1}})
    for i in range(workers):
        cluster.add_node(**NODE, num_cpus=1, resources={"rollout_slot": 1, f"worker{i}": 1})
    cluster.wait_for_nodes()
    print(f"RAY_ADDRESS={cluster.address}", flush=True)
    sys.stdin.read()  # until the test closes it
    cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
