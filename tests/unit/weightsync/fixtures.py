"""Small catalogs, adapters and manifests shared by the weight-sync unit tests."""

from __future__ import annotations

import torch

from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.wire.catalog import catalog_from_tensors
from lorarl.weightsync.wire.payload import build_manifest, pack

RANK = 4
FINGERPRINT = "sha256:tiny"
MODULES = ("layers.0.q_proj", "layers.0.down_proj")


def base_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed_tokens.weight": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "layers.0.q_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "layers.0.down_proj.weight": torch.randn(16, 24, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(16, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(50, 16, generator=g).to(torch.bfloat16),
    }


def lora_spec(rank: int = RANK, targets: tuple[str, ...] = ("all-linear",)) -> common_pb2.LoraSpec:
    return common_pb2.LoraSpec(rank=rank, alpha=2.0 * rank, target_modules=list(targets))


def catalog() -> weightsync_pb2.ModelCatalog:
    return catalog_from_tensors(base_weights().items())


def adapter(seed: int = 1, rank: int = RANK, modules: tuple[str, ...] = MODULES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = base_weights()
    out = {}
    for module in modules:
        o, i = base[f"{module}.weight"].shape
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, i, generator=g)
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(o, rank, generator=g)
    return out


def manifest_of(tensors: dict[str, torch.Tensor], *, version: int = 1, mode: int = common_pb2.SYNC_MODE_ADAPTER,
                job_id: str = "job", fingerprint: str = FINGERPRINT, bucket_bytes: int = 512
                ) -> tuple[common_pb2.WeightManifest, list]:
    buckets = list(pack(tensors.items(), bucket_bytes=bucket_bytes))
    manifest = build_manifest(job_id=job_id, version=version, mode=mode, base_model_fingerprint=fingerprint,
                              buckets=buckets, lora=lora_spec() if mode == common_pb2.SYNC_MODE_ADAPTER else None)
    return manifest, buckets


def register_request(mode: int = common_pb2.SYNC_MODE_ADAPTER, job_id: str = "job"
                     ) -> weightsync_pb2.RegisterJobRequest:
    return weightsync_pb2.RegisterJobRequest(job_id=job_id, base_model_fingerprint=FINGERPRINT, lora=lora_spec(),
                                             mode=mode, catalog=catalog())


def caps(lora: bool = True, rank: int = 64, loras: int = 4, engine: str = "vllm") -> weightsync_pb2.ReplicaCapabilities:
    return weightsync_pb2.ReplicaCapabilities(supports_lora=lora, max_lora_rank=rank, max_loras=loras, engine=engine,
                                              collective_backends=[common_pb2.COLLECTIVE_BACKEND_GLOO])
