"""A free TCP port, for an address a process must know before its peer binds it (a rendezvous, a service
whose address the others are started with)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now at ``host``; the caller binds it soon (another process could take it in
    between, which the caller sees as a failed bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
