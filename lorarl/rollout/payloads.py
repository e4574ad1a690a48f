"""Checks a policy payload against the model this replica serves, and turns it into what engines load.

Everything here runs before the engine is touched, so a bad payload is refused while the previous
version keeps serving: adapter names, halves, ranks and shapes; merged tensor names and shapes.
Merged payloads are completed from the pristine base (the engine always reloads a full, consistent
set: vLLM reprocesses whole layers), and adapters sent to a replica that cannot run LoRA are merged
here with the trainer's arithmetic (lorarl.weightsync.wire.merge).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from lorarl.common.errors import FailedPreconditionError, InvalidArgumentError
from lorarl.contract.lora import LoraSpec
from lorarl.contract.peft import PeftNameError, pair_tensors
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.schema import Mode

LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class PolicyPayload:
    """One verified version as it arrives: what it is, how to serve it, and its tensors (PEFT or HF names)."""

    job_id: str
    version: int
    mode: Mode  # what the tensors are
    serve_mode: Mode  # how to serve them (MERGED + ADAPTER tensors: merge locally)
    fingerprint: str
    tensors: Mapping[str, torch.Tensor]
    lora: LoraSpec | None = None
    weights: str = ""  # the version's own fingerprint (weightsync.wire.payload.version_fingerprint): what it is

    @property
    def local_merge(self) -> bool:
        return self.serve_mode is Mode.MERGED and self.mode is Mode.ADAPTER


def adapter_modules(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (lora_A, lora_B)}; INVALID_ARGUMENT for names that are not PEFT LoRA names or lone halves."""
    try:
        return pair_tensors(tensors)
    except PeftNameError as e:
        raise InvalidArgumentError("manifest.tensors", str(e)) from None


def check_adapter(tensors: Mapping[str, torch.Tensor], lora: LoraSpec, files: ModelFiles, max_rank: int
                  ) -> LoraSpec:
    """Validates an adapter for this model; returns its LoRA settings with the modules it really targets."""
    if lora.rank < 1:
        raise InvalidArgumentError("manifest.lora.rank", "must be >= 1")
    if lora.rank > max_rank:
        raise FailedPreconditionError(f"adapter rank {lora.rank} is above this engine's max_lora_rank {max_rank}")
    modules = adapter_modules(tensors)
    if not modules:
        raise InvalidArgumentError("manifest.tensors", "the adapter has no tensors")
    for module, (a, b) in modules.items():
        shape = files.shape(f"{module}.weight")
        if shape is None:
            raise FailedPreconditionError(f"adapter targets {module}, which this model ({files.architecture}) "
                                          "does not have")
        out_features, in_features = shape[0], shape[-1]
        if tuple(a.shape) != (lora.rank, in_features) or tuple(b.shape) != (out_features, lora.rank):
            raise FailedPreconditionError(
                f"adapter shapes for {module} do not fit this model: lora_A {list(a.shape)}, lora_B "
                f"{list(b.shape)}, expected [{lora.rank}, {in_features}] and [{out_features}, {lora.rank}]")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise InvalidArgumentError("manifest.tensors", f"{module}: adapter tensors must be floating point")
    targets = tuple(sorted({m.rsplit(".", 1)[-1] for m in modules}))
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, target_modules=targets, use_rslora=lora.use_rslora)


def check_merged(tensors: Mapping[str, torch.Tensor], files: ModelFiles) -> None:
    """Every tensor must be a weight of this model with the same shape (FAILED_PRECONDITION otherwise)."""
    for name, tensor in tensors.items():
        if name == LM_HEAD and files.tie_word_embeddings:
            continue
        shape = files.shape(name)
        if shape is None:
            raise FailedPreconditionError(
                f"merged tensor {name!r} is not a weight of this model ({files.architecture})")
        if tuple(tensor.shape) != shape:
            raise FailedPreconditionError(f"merged tensor {name!r} has shape {list(tensor.shape)}, "
                                          f"this model's is {list(shape)}")
        if not tensor.is_floating_point():
            raise InvalidArgumentError("manifest.tensors", f"{name}: merged weights must be floating point")


def check_loadable(tensors: Mapping[str, torch.Tensor], loaded: frozenset[str] | None, engine: str) -> None:
    """Every tensor sent must land in a parameter of the engine (``loaded``: the checkpoint names its own
    loader writes somewhere; None: all): a name the loader would skip fails the version, never silently."""
    if loaded is None:
        return
    skipped = sorted(n for n in tensors if n not in loaded)
    if skipped:
        raise FailedPreconditionError(
            f"merged tensor {skipped[0]!r} would not be loaded: {engine}'s loader writes it into no parameter "
            f"of the serving model{f' ({len(skipped) - 1} more such tensors)' if len(skipped) > 1 else ''}; "
            "nothing was loaded")


def complete_weights(tensors: Mapping[str, torch.Tensor], files: ModelFiles, loaded: frozenset[str] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint weight the engine loads (``loaded``; None: all): the payload's where it has one, the
    pristine base elsewhere (checkpoint order)."""
    names = [n for n in files.weight_names() if loaded is None or n in loaded or n in tensors]
    missing = [n for n in names if n not in tensors]
    base = dict(files.tensors(missing)) if missing else {}
    for name in names:
        yield name, tensors[name] if name in tensors else base[name]


def merge_adapter(tensors: Mapping[str, torch.Tensor], lora: LoraSpec, files: ModelFiles
                  ) -> dict[str, torch.Tensor]:
    """W + B @ A * scale for each adapted module, from the pristine base (same arithmetic as the trainer)."""
    from lorarl.weightsync.wire.merge import merged_from_adapter

    return dict(merged_from_adapter(tensors, lora, files.tensor))
