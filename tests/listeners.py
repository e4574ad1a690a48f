"""Which addresses a process tree listens on: the check behind "no listener on an interface the
configuration did not name" (a wildcard TCPStore or gloo listener would show up as 0.0.0.0 or ::)."""

from __future__ import annotations

import psutil


def listening_addresses(pid: int) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of ``pid`` and all its descendants."""
    root = psutil.Process(pid)
    found = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        found |= {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port, process.pid)  # IPv4-mapped = the IPv4 one
                  for c in connections if c.status == psutil.CONN_LISTEN}
    return found
