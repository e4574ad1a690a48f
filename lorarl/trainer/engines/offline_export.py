"""A PEFT adapter or a merged Hugging Face model from a training checkpoint, with no service running.

The checkpoint is loaded into the engine that wrote it, rebuilt from the checkpoint's own manifest
(base model, LoRA, dtype, loss), and exported by that engine's export code: the files are the ones
the live trainer's Export RPC writes for the same state. The base model comes from the manifest
(checkpoints record its path) or from ``base_model``; its fingerprint must match the checkpoint's. The adapter
names its base as the job did (the name the checkpoint records), wherever the base is read from now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.trainer.engines import checkpoint as ckpt
from lorarl.trainer.engines.api import MemorySpec, TrainingSpec
from lorarl.trainer.rl.lora import LoraConfig
from lorarl.trainer.rl.losses import LossSpec

ExportMode = Literal["adapter", "merged"]


def spec_from_manifest(path: Path, manifest: dict[str, Any], base_model: str | Path | None) -> TrainingSpec:
    """The TrainingSpec the checkpoint's engine was created with, as far as exporting needs it."""
    base = str(base_model or manifest.get("base_model_path") or "")
    if not base:
        raise ckpt.CheckpointError(f"checkpoint {path} does not record its base model: pass --base-model DIR")
    if not (Path(base) / "config.json").is_file():
        raise ckpt.CheckpointError(f"base model {base} is not a Hugging Face model directory (no config.json)"
                                   + ("" if base_model else "; pass --base-model DIR where it lives now"))
    engine = manifest.get("engine", "torch")
    if engine != "torch":
        raise ckpt.CheckpointError(f"checkpoint {path} was written by the {engine!r} engine; offline export reads "
                                   "torch-engine checkpoints (load it into a trainer, then `lorarl export --trainer`)")
    fingerprint = base_model_fingerprint(base)
    if fingerprint != manifest.get("base_model_fingerprint"):
        raise ckpt.CheckpointMismatchError(f"base model {base} (fingerprint {fingerprint}) is not the one checkpoint "
                                           f"{path} was trained on ({manifest.get('base_model_fingerprint')})")
    try:
        lora_fields = dict(manifest.get("lora") or {})
        lora = LoraConfig(**{**lora_fields, "target_modules": tuple(lora_fields.get("target_modules", ()))}) \
            if lora_fields else LoraConfig()
        return TrainingSpec(base_model_path=base, device="cpu", dtype=manifest.get("dtype") or "float32", lora=lora,
                            base_model_name=str(manifest.get("base_model_name") or ""),
                            loss=loss_from_manifest(manifest.get("loss") or {}),
                            full_finetune=bool(manifest.get("full_finetune")),
                            memory=MemorySpec(activation_checkpointing="off"))
    except (TypeError, ValueError) as e:
        raise ckpt.CheckpointCorruptError(f"checkpoint {path}: {ckpt.MANIFEST} holds an unusable job ({e})") from e


def loss_from_manifest(fields: dict) -> LossSpec:
    """The loss a checkpoint recorded; checkpoints from before lorarl.contract.training name its type "name"."""
    fields = dict(fields)
    if "name" in fields and "type" not in fields:
        fields["type"] = fields.pop("name")
    return LossSpec.from_dict(fields)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, mode: ExportMode,
                      base_model: str | Path | None = None) -> Path:
    """Writes ``mode`` (adapter: PEFT; merged: HF) for ``checkpoint`` to ``out_dir``; CheckpointError if the
    checkpoint is missing, corrupt or foreign to the base model."""
    from lorarl.trainer.engines.torch.engine import TorchEngine

    path = Path(checkpoint)
    manifest = ckpt.read_manifest(path)
    spec = spec_from_manifest(path, manifest, base_model)
    if mode == "adapter" and spec.full_finetune:
        raise ckpt.CheckpointError(f"checkpoint {path} is a full fine-tune: it has no adapter (use --mode merged)")
    engine = TorchEngine(spec)
    engine.load_checkpoint(path)
    return engine.export_adapter(out_dir) if mode == "adapter" else engine.export_merged(out_dir)
