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


def listening(host: str, port: int, timeout_s: float = 5.0, attempts: int = 3, pause_s: float = 0.5) -> str:
    """'' when something accepts TCP connections at host:port, else why not. A collective group's
    rendezvous store lives in its sender (the trainer), so a refused connection means the sender is
    gone: joining would only wait out the collective timeout (torch's store client retries until then)."""
    import time

    error: OSError | None = None
    for attempt in range(attempts):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return ""
        except OSError as exc:
            error = exc
            if attempt + 1 < attempts:
                time.sleep(pause_s)
    return f"{type(error).__name__}: {error}"
