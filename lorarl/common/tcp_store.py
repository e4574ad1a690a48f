"""A torch.distributed TCPStore master that listens on one named address, not on every interface.

torch's TCPStore master binds the wildcard address (``*:port`` in ``ss -ltn``) whatever host it is
given, and the store has no authentication: anyone who reaches the port can read and write the
rendezvous keys. So we bind the listening socket ourselves, to the host the configuration named,
and hand it to the store (``master_listen_fd``); clients connect exactly as before.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

LISTEN_BACKLOG = 1024


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host`` (a name resolves to its first address) and listening."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def master_store(host: str, port: int = 0, world_size: int | None = None, timeout_s: float = 120.0,
                 wait_for_workers: bool = False) -> dist.TCPStore:
    """A master store listening on ``host``:``port`` only (0: a free port, read back from ``.port``)."""
    sock = listening_socket(host, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(host, bound, world_size, True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=wait_for_workers, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def client_store(host: str, port: int, world_size: int | None = None, timeout_s: float = 120.0) -> dist.TCPStore:
    """A store connected to the master at ``host``:``port``."""
    return dist.TCPStore(host, port, world_size, False, timeout=timedelta(seconds=timeout_s))
