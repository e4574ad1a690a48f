"""A tiny Qwen3 built from a seed on both sides (trainer and replicas), and a sink that serves it.

ModelSink is the "real check": it applies a version to a transformers model the way an engine
would (adapter through LoRA layers, merged weights by overwriting, or a local merge into the
pristine base), so tests can compare its logits with the trainer's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lorarl.contract.lora import LoraSpec
from lorarl.trainer.rl.lora import (
    LoraConfig,
    inject_lora,
    iter_merged_weights,
    load_peft_state_dict,
    lora_parameters,
    peft_state_dict,
)
from lorarl.v1 import common_pb2
from lorarl.weightsync.client.sinks import ADAPTER, PolicyUpdate
from lorarl.weightsync.wire.catalog import catalog_from_tensors
from lorarl.weightsync.wire.merge import merged_from_adapter

CONFIG = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}
FINGERPRINT = "sha256:tiny-qwen3-seed0"
RANK, ALPHA = 4, 8.0
INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 7, 11, 64, 90]])


def base_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**CONFIG)).eval()


def lora_spec() -> common_pb2.LoraSpec:
    return common_pb2.LoraSpec(rank=RANK, alpha=ALPHA, target_modules=["all-linear"])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).logits[0].float()


class TinyTrainer:
    """The trainer side: frozen base plus LoRA whose values change deterministically per version."""

    def __init__(self) -> None:
        self.model = base_model()
        inject_lora(self.model, LoraConfig(rank=RANK, alpha=ALPHA))

    def step(self, version: int) -> None:
        g = torch.Generator().manual_seed(1000 + version)
        with torch.no_grad():
            for p in lora_parameters(self.model):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def adapter(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in peft_state_dict(self.model).items()}

    def merged(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_merged_weights(self.model)

    def catalog(self):
        return catalog_from_tensors(iter_merged_weights(self.model, merge=False))

    def logits(self) -> torch.Tensor:
        return logits(self.model)


class ModelSink:
    """PolicySink over a transformers model (see module docstring)."""

    def __init__(self) -> None:
        self.base = {n: t.clone() for n, t in base_model().state_dict().items()}
        self.model: torch.nn.Module = base_model()
        self.staged: dict[str, PolicyUpdate] = {}
        self.active: dict[str, int] = {}
        self.lock = threading.Lock()

    def active_versions(self) -> dict[str, int]:
        return dict(self.active)

    def stage(self, update: PolicyUpdate) -> None:
        self.staged[update.job_id] = PolicyUpdate(update.manifest, {n: t.clone() for n, t in update.tensors.items()},
                                                  update.serve_mode)

    def commit(self, job_id: str, version: int) -> None:
        update = self.staged.pop(job_id)
        assert update.version == version
        model = base_model()
        if update.serve_mode == ADAPTER:
            lora = update.manifest.lora
            inject_lora(model, LoraConfig(rank=lora.rank, alpha=lora.alpha))
            load_peft_state_dict(model, update.tensors)
        elif update.local_merge:
            merged = dict(merged_from_adapter(update.tensors, LoraSpec.from_proto(update.manifest.lora),
                                              self.base.__getitem__))
            model.load_state_dict(merged, strict=False)
        else:
            missing = model.load_state_dict(update.tensors, strict=False)
            assert not missing.unexpected_keys, missing.unexpected_keys
        with self.lock:
            self.model = model
            self.active[job_id] = version

    def abort(self, job_id: str, version: int) -> None:
        if job_id in self.staged and self.staged[job_id].version == version:
            del self.staged[job_id]

    def logits(self) -> torch.Tensor:
        with self.lock:
            return logits(self.model)
