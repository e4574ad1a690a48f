"""Which local address peers can reach us at, when nobody said.

Collective groups need each rank to announce a reachable address (the trainer's is the group's
master). The best guess without configuration is the local address of the route to the weight-sync
service: whoever can reach the service is likely on the same network.
"""

from __future__ import annotations

import socket


def split_target(target: str) -> tuple[str, int]:
    """('host', port) from 'host:port' or '[v6]:port' (dns:/// and ipv4: prefixes allowed)."""
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix):]
    host, _, port = target.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port or 0)


def local_address_towards(target: str) -> str:
    """The local IP the kernel would use to reach `target` (no packet is sent)."""
    host, port = split_target(target)
    try:
        info = socket.getaddrinfo(host, port or 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
