"""Checks a manifest against its job: the base model's tensor catalog and the job's LoRA spec.

payload.validate_manifest proves a manifest is self-consistent; this module proves it belongs to
the job, so a rollout never receives an adapter for another model, a wrong rank, or a merged
tensor whose shape would not load. Errors are InvalidArgumentError naming the offending field.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.lora import ALL_LINEAR, NOT_LINEAR
from lorarl.contract.peft import NAME_PATTERN, parse_tensor_name
from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.wire.payload import DTYPE_TO_PROTO

FLOAT_DTYPES = frozenset({common_pb2.D_TYPE_FLOAT32, common_pb2.D_TYPE_BFLOAT16, common_pb2.D_TYPE_FLOAT16})


def catalog_from_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> weightsync_pb2.ModelCatalog:
    """The catalog (names, shapes, dtypes) of a model's weights, e.g. iter_merged_weights(model, merge=False)."""
    catalog = weightsync_pb2.ModelCatalog()
    for name, t in tensors:
        catalog.tensors.add(name=name, shape=list(t.shape), dtype=DTYPE_TO_PROTO.get(t.dtype, 0))
    return catalog


@dataclass(frozen=True)
class CatalogEntry:
    shape: tuple[int, ...]
    dtype: int


class JobCatalog:
    """What a job's payloads may contain: its catalog indexed by name, and its LoRA spec."""

    def __init__(self, job_id: str, fingerprint: str, lora: common_pb2.LoraSpec,
                 catalog: weightsync_pb2.ModelCatalog) -> None:
        self.job_id, self.fingerprint, self.lora = job_id, fingerprint, lora
        self.entries = {t.name: CatalogEntry(tuple(t.shape), t.dtype) for t in catalog.tensors}
        targets = set(lora.target_modules)
        self.all_linear = not targets or ALL_LINEAR in targets
        self.targets = frozenset(targets - {ALL_LINEAR})

    def adapts(self, module: str) -> bool:
        """Whether the LoRA spec allows an adapter on `module` (by its leaf name)."""
        leaf = module.rsplit(".", 1)[-1]
        if self.lora.expert_mode == common_pb2.EXPERT_ADAPTER_MODE_NONE and ".experts." in f".{module}.":
            return False
        if self.all_linear:
            return leaf not in NOT_LINEAR
        return leaf in self.targets

    def check(self, manifest: common_pb2.WeightManifest, field: str = "manifest") -> None:
        """Raises InvalidArgumentError unless every tensor agrees with the catalog and LoRA spec."""
        if manifest.mode == common_pb2.SYNC_MODE_ADAPTER:
            self._check_adapter(manifest, field)
        else:
            self._check_merged(manifest, field)

    def _check_merged(self, manifest: common_pb2.WeightManifest, field: str) -> None:
        for i, t in enumerate(manifest.tensors):
            where = f"{field}.tensors[{i}]"
            entry = self.entries.get(t.name)
            if entry is None:
                raise InvalidArgumentError(where, f"{t.name!r} is not a tensor of the base model catalog")
            if tuple(t.shape) != entry.shape:
                raise InvalidArgumentError(where, f"{t.name}: shape {list(t.shape)} != catalog {list(entry.shape)}")
            if entry.dtype and t.dtype != entry.dtype:
                raise InvalidArgumentError(
                    where, f"{t.name}: dtype {common_pb2.DType.Name(t.dtype)} != catalog "
                           f"{common_pb2.DType.Name(entry.dtype)}")

    def _check_adapter(self, manifest: common_pb2.WeightManifest, field: str) -> None:
        rank = self.lora.rank
        if manifest.HasField("lora") and manifest.lora.rank and manifest.lora.rank != rank:
            raise InvalidArgumentError(f"{field}.lora.rank", f"{manifest.lora.rank} != job rank {rank}")
        halves: dict[str, set[str]] = {}
        for i, t in enumerate(manifest.tensors):
            where = f"{field}.tensors[{i}]"
            parsed = parse_tensor_name(t.name)
            if parsed is None:
                raise InvalidArgumentError(
                    where, f"{t.name!r} is not an adapter tensor ({NAME_PATTERN})")
            module, which = parsed
            base = self.entries.get(f"{module}.weight")
            if base is None or len(base.shape) != 2:
                raise InvalidArgumentError(where, f"{t.name}: no 2-D base weight {module}.weight in the catalog")
            if not self.adapts(module):
                raise InvalidArgumentError(where, f"{t.name}: {module} is not a target of the job's LoRA spec")
            if t.dtype not in FLOAT_DTYPES:
                raise InvalidArgumentError(where, f"{t.name}: adapter dtype must be float32, bfloat16 or float16")
            out_f, in_f = base.shape
            want = (rank, in_f) if which == "A" else (out_f, rank)
            if tuple(t.shape) != want:
                raise InvalidArgumentError(
                    where, f"{t.name}: shape {list(t.shape)} != {list(want)} (rank {rank}, base [{out_f}, {in_f}])")
            halves.setdefault(module, set()).add(which)
        for module, got in halves.items():
            if got != {"A", "B"}:
                missing = ({"A", "B"} - got).pop()
                raise InvalidArgumentError(f"{field}.tensors", f"{module}: lora_{missing} is missing")
