"""Per-job credentials: a key that may use only the jobs it names, on a trainer many teams share.

The service token (`server.auth`) is the operator's: every job. Each `trainer.tenants` entry is a key of its
own, for the job ids it lists (exact ids or shell-style patterns, 'team-a-*'): a caller presenting it may
create, read, train, checkpoint, export, publish and delete those jobs only — anything else is
PERMISSION_DENIED, and ListJobs shows it only its own. Its checkpoint and export paths stay inside its job's
folders, and a job it creates may start only from its own jobs' files there (a base or a warm start), so it
cannot read or overwrite another job's files either; a trainer with tenants confines every model path to
`trainer.model_roots`. The auth interceptor accepts the keys
(lorarl.common.auth); this module decides, from the same metadata, what each may touch.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.common.auth import presented_token, resolve_token, tokens_match
from lorarl.common.config import ConfigError
from lorarl.common.errors import PermissionDeniedError


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str
    jobs: tuple[str, ...]

    def allows(self, job_id: str) -> bool:
        return any(fnmatch.fnmatchcase(job_id, pattern) for pattern in self.jobs)


class Tenants:
    """The configured keys; ``of(metadata)`` is the caller's tenant, or None for the service token."""

    def __init__(self, tenants: Sequence[Tenant] = ()) -> None:
        self.tenants = tuple(tenants)

    @classmethod
    def from_settings(cls, entries: Iterable[Any]) -> Tenants:
        tenants = []
        for i, entry in enumerate(entries):
            token = resolve_token(token=entry.token, token_file=entry.token_file, token_env=entry.token_env or None)
            if not token:
                raise ConfigError(f"trainer.tenants[{i}]", f"tenant {entry.name!r} has no key: set token_file or "
                                                           "token_env")
            tenants.append(Tenant(entry.name, token, tuple(entry.jobs)))
        tokens = [t.token for t in tenants]
        if len(set(tokens)) != len(tokens):
            raise ConfigError("trainer.tenants", "two tenants share a key; each needs its own")
        return cls(tenants)

    @property
    def tokens(self) -> list[str]:
        return [t.token for t in self.tenants]

    def of(self, metadata: Iterable[tuple[str, Any]] | None) -> Tenant | None:
        presented = presented_token(metadata)
        if presented is None:
            return None
        return next((t for t in self.tenants if tokens_match(presented, t.token)), None)

    def check(self, metadata: Iterable[tuple[str, Any]] | None, job_id: str) -> Tenant | None:
        """The caller's tenant when it may use ``job_id`` (None: the service token); else PERMISSION_DENIED."""
        tenant = self.of(metadata)
        if tenant is not None and not tenant.allows(job_id):
            raise PermissionDeniedError(f"the key of tenant {tenant.name!r} may use jobs {list(tenant.jobs)}; "
                                        f"job {job_id!r} is not one of them", field="job_id")
        return tenant

    def visible(self, metadata: Iterable[tuple[str, Any]] | None, job_ids: Iterable[str]) -> list[str]:
        tenant = self.of(metadata)
        return [j for j in job_ids if tenant is None or tenant.allows(j)]


def check_own_paths(tenant: Tenant, paths: dict[str, str], job_roots: Sequence[str]) -> None:
    """A tenant's job may start from files in the trainer's checkpoint and export folders only where they are
    its own jobs' (``<root>/<job id>/...``): another job's adapter or merged export is another tenant's data."""
    for field, path in paths.items():
        if not path:
            continue
        resolved = Path(path).resolve()
        for root in job_roots:
            base = Path(root).resolve()
            if base in resolved.parents:
                owner = resolved.relative_to(base).parts[0]
                if not tenant.allows(owner):
                    raise PermissionDeniedError(f"{path!r} is job {owner!r}'s, which the key of tenant "
                                                f"{tenant.name!r} may not use", field=field)
