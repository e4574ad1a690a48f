"""One resident base model for every torch-engine job on it: each job brings only its adapter.

Jobs whose base is the same (model directory, dtype, device, layer split) share one copy of its weights.
A job's engine keeps its own adapter slot (lorarl.trainer.rl.lora.AdapterSlot: its rank, alpha, targets,
experts), optimizer moments, step counter, RNG, loss, schedule and data. The jobs take turns on the base:
an engine call holds the base for the call, with that job's adapters attached and its own RNG state in
place, so each job computes exactly what it would alone (the isolation test holds it bit for bit). The RNG
streams are process-wide: jobs on *other* bases (their own threads) draw from them too, so the isolation
holds among the jobs of one base.
Turns, not one pass over several jobs' rows at once: on CPU that paid only for tiny steps and not at a real
step's size (bench/multi_lora_pass.py), and it would hold every job's activations together.

Co-located with the rollout engine (placement.colocate, issue "one base"), the base's weights are not even the
trainer's own: ``alias_base`` makes every parameter a view of the shared memory file the engine generates from
(lorarl.contract.base_segment), mapped read-only, so no step can write the base.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lorarl.trainer.rl.lora import AdapterSlot, activate

logger = logging.getLogger(__name__)


class Tenant(Protocol):
    """What takes turns on a base: a job's engine (its adapters, its RNG)."""

    slot: AdapterSlot
    rng: RngState

    def on_turn(self) -> None:
        """Puts the tenant's own model-wide settings back (its activation checkpointing mode)."""


@dataclass(frozen=True)
class BaseKey:
    """What makes two jobs' bases one: the same weights, in the same dtype, on the same devices."""

    path: str
    dtype: str
    device: str
    layer_devices: int

    @classmethod
    def of(cls, spec: Any) -> BaseKey:
        return cls(str(Path(spec.base_model_path).resolve()), spec.dtype, spec.device, spec.layer_devices)


@dataclass
class RngState:
    """The RNG streams a job draws from (dropout, sampling of its own): python's and torch's, CPU and device."""

    python: Any = None
    torch_cpu: torch.Tensor | None = None
    device: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def capture(cls) -> RngState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        return cls(random.getstate(), torch.get_rng_state(), cuda)

    def restore(self) -> None:
        if self.python is not None:
            random.setstate(self.python)
        if self.torch_cpu is not None:
            torch.set_rng_state(self.torch_cpu)
        if self.device:
            torch.cuda.set_rng_state_all(self.device)


class SharedBase:
    """A loaded base model and whose turn it is; ``turn`` is the only way a tenant computes on it."""

    def __init__(self, key: BaseKey, model: nn.Module, fingerprint: str, layers_per_device: list[int]) -> None:
        self.key, self.model, self.fingerprint = key, model, fingerprint
        self.layers_per_device = layers_per_device
        self.lock = threading.RLock()
        self.tenants: list[Tenant] = []
        self._active: Tenant | None = None

    @property
    def base_bytes(self) -> int:
        """Bytes of the base weights (every parameter and buffer no tenant trains), counted once."""
        trainable = {id(p) for t in self.tenants for a in t.slot.adapters.values() for p in _params(a)}
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers())
                   if id(t) not in trainable)

    def pause(self) -> None:
        """Ends the active tenant's turn (its RNG kept, its adapters detached): a new tenant is being added.
        Call with ``lock`` held, up to ``join``."""
        if self._active is not None:
            self._active.rng = RngState.capture()
            activate(self.model, None)
            self._active = None

    def join(self, tenant: Tenant) -> None:
        """A new tenant whose slot ``attach_lora`` just attached, its RNG seeded: its turn until another's."""
        with self.lock:
            self.tenants.append(tenant)
            self._active = tenant

    def leave(self, tenant: Tenant) -> None:
        with self.lock:
            self.tenants = [t for t in self.tenants if t is not tenant]
            if self._active is tenant:
                activate(self.model, None)
                self._active = None

    @contextlib.contextmanager
    def turn(self, tenant: Tenant) -> Iterator[None]:
        """Holds the base with ``tenant``'s adapters attached and its RNG streams in place (re-entrant)."""
        with self.lock:
            if self._active is not tenant:
                if self._active is not None:
                    self._active.rng = RngState.capture()
                activate(self.model, tenant.slot)
                tenant.rng.restore()
                tenant.on_turn()
                self._active = tenant
            yield


def _params(adapter: Any) -> list[nn.Parameter]:
    a, b = adapter.lora_a, adapter.lora_b
    if isinstance(a, nn.ParameterDict):
        return [*a.values(), *b.values()]
    return [a, b]


def alias_base(model: nn.Module, segment: Any) -> int:
    """Makes every parameter of ``model`` (loaded from the checkpoint) the shared base's view of the same
    checkpoint tensor (lorarl.contract.base_layout), after checking each holds the very same values: a layout that
    puts a tensor in the wrong place is caught here, at load, not by rollouts drifting. Returns the parameters
    aliased; ValueError naming a parameter without a view, a view without a parameter, or differing values."""
    views = segment.part_views()
    names_of: dict[int, list[str]] = {}
    objects: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        objects[id(param)] = param
    problems, used = [], set()
    for key, names in names_of.items():
        source = next((n for n in names if n in views), None)
        old = objects[key]
        if source is None:
            problems.append(f"{names[0]} is not in the shared base")
            continue
        view = views[source]
        if old.shape != view.shape or old.dtype != view.dtype:
            problems.append(f"{source}: the trainer holds {old.dtype} {list(old.shape)}, the shared base "
                            f"{view.dtype} {list(view.shape)}")
            continue
        if not torch.equal(old.detach().to(view.device), view):  # on a device, one tensor's copy at a time
            problems.append(f"{source}: the shared base's values differ from the checkpoint's")
            continue
        used.add(source)
        old.data = view  # the same Parameter (ties kept); the checkpoint's own bytes go
    problems += [f"shared tensor {n} is no parameter of the model" for n in sorted(set(views) - used)]
    if problems:
        raise ValueError("the shared base does not match this model: " + "; ".join(problems[:6])
                         + (f"; ... {len(problems) - 6} more" if len(problems) > 6 else ""))
    model.lorarl_segment = segment  # the mapping lives as long as the model
    return len(used)


class BaseRegistry:
    """The bases resident in one trainer process, by key; a base goes when its last tenant does.
    ``shared_path``: the co-located job's shared base (trainer.shared_base), which a base of the same model takes
    its weights from (``alias_base``)."""

    def __init__(self, shared_path: str = "") -> None:
        self.shared_path = shared_path
        self._bases: dict[BaseKey, SharedBase] = {}
        self._loading: dict[BaseKey, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: BaseKey) -> SharedBase | None:
        with self._lock:
            return self._bases.get(key)

    def get_or_load(self, key: BaseKey, load: Callable[[], SharedBase]) -> tuple[SharedBase, bool]:
        """The resident base for ``key``, or one ``load`` builds (loaded and placed on its devices); True when
        it was already resident. Two jobs asking for a new base at once load it once: the second waits."""
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:  # seconds to minutes, outside the registry's lock: other bases stay reachable
            with self._lock:
                base = self._bases.get(key)
            if base is not None:
                return base, True
            base = load()
            with self._lock:
                self._bases[key] = base
            return base, False

    def release(self, base: SharedBase, tenant: Tenant) -> None:
        base.leave(tenant)
        with self._lock:
            if not base.tenants and self._bases.get(base.key) is base:
                del self._bases[base.key]
                self._loading.pop(base.key, None)
                logger.info("base %s unloaded: its last job is gone", base.key.path)

    def __len__(self) -> int:
        with self._lock:
            return len(self._bases)
