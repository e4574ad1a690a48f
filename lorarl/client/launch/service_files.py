"""The services a run directory names, read from what the launcher and the services wrote in RUN_DIR/services/:
each process's ready file (``NAME.ready.json``: its address and pid, removed when it stops cleanly), else the
stack's ``stack.json`` (the Ray launcher's services write their ready files on their own nodes), and the token
the launcher wrote for them (removed when it stops them). Whether each answers is asked of the standard gRPC
health service, which needs no token, with a short deadline: a stopped or hung service is "not answering",
never a wait."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

READY_SUFFIX = ".ready.json"


@dataclass
class RecordedService:
    name: str  # the process: "trainer", "rollout-1"
    service: str  # what it serves: trainer, rollout, weightsync
    address: str
    pid: int | None = None
    tls: bool = False
    up: bool | None = None  # None: not asked (TLS: the health probe here is plaintext)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def recorded_services(services_dir: Path) -> list[RecordedService]:
    """Every service process the run directory names, in the launcher's start order where it can be told."""
    found = []
    for path in sorted(services_dir.glob(f"*{READY_SUFFIX}")):
        try:
            info = json.loads(path.read_text())
            found.append(RecordedService(path.name[: -len(READY_SUFFIX)], str(info.get("service", "")),
                                        str(info["address"]), int(info["pid"]) if info.get("pid") else None,
                                        bool(info.get("tls"))))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written by a service starting now: its next read finds it whole
    if found:
        order = {"weightsync": 0, "trainer": 1, "rollout": 2}
        return sorted(found, key=lambda p: (order.get(p.service, 3), p.name))
    return _from_stack_file(services_dir / "stack.json")


def _from_stack_file(path: Path) -> list[RecordedService]:
    try:
        stack = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    found = []
    for service in ("weightsync", "trainer", "rollout"):
        addresses = stack.get(service) if isinstance(stack, dict) else None
        addresses = [addresses] if isinstance(addresses, str) else addresses if isinstance(addresses, list) else []
        for i, address in enumerate(a for a in addresses if isinstance(a, str)):
            found.append(RecordedService(service if len(addresses) == 1 else f"{service}-{i}", service, address))
    return found


def read_token(services_dir: Path) -> str | None:
    """The services' bearer token as the launcher wrote it (owner-only), None when it is gone or not ours."""
    try:
        return (services_dir / "token").read_text().strip() or None
    except OSError:
        return None


def probe_all(processes: list[RecordedService], timeout_s: float) -> None:
    """Sets each process's ``up``: whether it answers SERVING within ``timeout_s`` (all asked at once)."""
    from lorarl.common.health_probe import probe

    plain = [p for p in processes if not p.tls]
    with ThreadPoolExecutor(max_workers=max(1, len(plain))) as pool:
        for process, serving in zip(plain, pool.map(lambda p: probe(p.address, "", timeout_s), plain), strict=True):
            process.up = serving
