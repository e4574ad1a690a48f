"""One base (placement.colocate) without an engine: the layout every side reads by, the memory file the launcher
builds from a real checkpoint, adapter handoffs as memory files, and who the weight-sync service sends one to.
The live engine's side of it: tests/integration/rollout/test_vllm_shared_base.py."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from lorarl.contract import base_layout, base_segment
from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.platform import shared_memory
from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.client.agent import StageError, WeightSyncAgent, verified_tensors
from lorarl.weightsync.service.config import WeightSyncSettings
from lorarl.weightsync.service.planning import plan_publish
from lorarl.weightsync.service.replicas import Replica
from lorarl.weightsync.wire.payload import PayloadError
from tests.unit.rollout.models import dense_model_dir
from tests.unit.weightsync.fixtures import adapter, caps, lora_spec, manifest_of


def shapes(**named: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {f"model.layers.0.{k.replace('__', '.')}.weight": (v, "BF16") for k, v in named.items()}


def test_fused_projections_are_their_parts_rows_in_the_engines_order_and_the_vocabulary_is_padded() -> None:
    checkpoint = {**shapes(self_attn__k_proj=(4, 16), self_attn__q_proj=(8, 16), self_attn__v_proj=(4, 16),
                           mlp__up_proj=(24, 16), mlp__gate_proj=(24, 16), mlp__down_proj=(16, 24)),
                  "model.embed_tokens.weight": ((100, 16), "BF16"), "lm_head.weight": ((100, 16), "BF16")}
    by_name = {t.name: t for t in base_layout.layout(checkpoint, tied=False)}
    qkv = by_name["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (16, 16)
    assert [(p.checkpoint.split(".")[-2], p.start, p.stop) for p in qkv.parts] == [
        ("q_proj", 0, 8), ("k_proj", 8, 12), ("v_proj", 12, 16)]  # the engine's order, not the file's
    gate_up = by_name["model.layers.0.mlp.gate_up_proj.weight"]
    assert [(p.checkpoint.split(".")[-2], p.start) for p in gate_up.parts] == [("gate_proj", 0), ("up_proj", 24)]
    assert by_name["model.embed_tokens.weight"].shape == (128, 16)  # vLLM pads vocabulary rows to 64
    assert by_name["lm_head.weight"].shape == (128, 16)
    tied = {t.name for t in base_layout.layout(checkpoint, tied=True)}
    assert "lm_head.weight" not in tied and "model.embed_tokens.weight" in tied  # the head IS the embedding


def test_a_fused_projection_missing_a_part_or_in_another_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lacks \['v_proj'\]"):
        base_layout.layout(shapes(self_attn__q_proj=(8, 16), self_attn__k_proj=(4, 16)), tied=False)
    mixed = shapes(mlp__gate_proj=(24, 16), mlp__up_proj=(24, 16))
    mixed["model.layers.0.mlp.up_proj.weight"] = ((24, 16), "F32")
    with pytest.raises(ValueError, match="does not stack"):
        base_layout.layout(mixed, tied=False)


@pytest.fixture(scope="module")
def segment_fd() -> int:
    fd = shared_memory.create()
    base_segment.build(fd, dense_model_dir())
    yield fd
    os.close(fd)


def test_the_memory_file_holds_every_checkpoint_tensor_byte_for_byte_read_only(segment_fd: int) -> None:
    model_dir = dense_model_dir()
    segment = base_segment.open_segment(shared_memory.path_of(segment_fd), base_model_fingerprint(model_dir))
    checkpoint = load_file(model_dir / "model.safetensors")
    parts = segment.part_views()
    assert set(parts) == set(checkpoint) - ({"lm_head.weight"} if base_segment.tied_embeddings(model_dir) else set())
    for name, part in parts.items():
        assert torch.equal(part, checkpoint[name]), name
    assert all(offset % part.element_size() == 0 for offset, part in
               ((segment.offsets[n], segment.views()[n]) for n in segment.tensors))
    assert min(segment.offsets.values()) % base_segment.ALIGN == 0  # the data starts on a page
    with pytest.raises(TypeError):  # mapped read-only: no service can write the base through it
        segment.buffer[0:1] = b"x"
    # the file is a safetensors file too: a person (or safetensors) can read it
    assert set(load_file(shared_memory.path_of(segment_fd))) == set(segment.tensors)


def test_the_engine_does_not_start_on_a_parameter_that_left_the_shared_base(segment_fd: int) -> None:
    """The loader's check after vLLM's post-load processing: a parameter copied (or repacked) out of the mapping,
    or emptied, stops the start by name; views of the mapping pass."""
    from torch import nn

    from lorarl.rollout.vllm.shared_loader import check_served_from

    segment = base_segment.open_segment(shared_memory.path_of(segment_fd))
    model = nn.Module()
    for index, view in enumerate(segment.views().values()):
        model.register_parameter(f"p{index}", nn.Parameter(view, requires_grad=False))
        model.register_buffer(f"n{index}", torch.zeros(1))  # buffers (rotary caches) are the engine's own
    assert check_served_from(model, segment) == len(segment.tensors)
    model.p1.data = model.p1.data.clone()
    model.p2.data = torch.empty(0)
    with pytest.raises(ValueError, match=r"2 of the engine's \d+ parameters do not lie in the shared base.*p1, p2"):
        check_served_from(model, segment)


@pytest.mark.parametrize("shape", [(3, 5, 8), (8, 8), (40, 8), (1, 8), (0, 8)])
def test_a_shared_weight_computes_what_a_linear_layer_computes(shape: tuple[int, ...]) -> None:
    from lorarl.rollout.vllm.shared_loader import shared_linear

    x, weight, bias = torch.randn(*shape), torch.randn(6, 8), torch.randn(6)
    for b in (None, bias):
        got = shared_linear(x, weight, b)
        assert got.shape == (*shape[:-1], 6) and got.is_contiguous()
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b))


def test_a_memory_file_of_another_model_or_no_shared_base_is_refused_with_what_to_do(segment_fd, tmp_path) -> None:
    path = shared_memory.path_of(segment_fd)
    with pytest.raises(shared_memory.SegmentError, match="this service's model is sha256:other"):
        base_segment.open_segment(path, "sha256:other")
    with pytest.raises(shared_memory.SegmentError, match="started by the launcher that holds it"):
        base_segment.open_segment(tmp_path / "gone")
    (tmp_path / "model.safetensors").write_bytes((dense_model_dir() / "model.safetensors").read_bytes())
    with pytest.raises(shared_memory.SegmentError, match="not a lorarl-shared-base-1 shared base"):
        base_segment.open_segment(tmp_path / "model.safetensors")


def test_an_adapter_handoff_is_a_memory_file_the_receiver_maps_and_checks_like_any_transfer() -> None:
    tensors = adapter()
    manifest, buckets = manifest_of(tensors)
    fd, total = shared_memory.write_buffers([b.buffer for b in buckets])
    try:
        assert total == sum(b.nbytes for b in manifest.buckets) and len(buckets) > 1
        buffers = shared_memory.read_buffers(os.getpid(), fd, [b.nbytes for b in manifest.buckets])
        received = verified_tensors(manifest, buffers)
        assert set(received) == set(tensors) and all(torch.equal(received[n], tensors[n]) for n in tensors)
        with pytest.raises(shared_memory.SegmentError, match=r"holds \d+ bytes, the manifest"):
            shared_memory.read_buffers(os.getpid(), fd, [total + 1])
        # a byte changed in the file after it was described is caught by the manifest's checksums
        with open(f"/proc/self/fd/{fd}", "r+b") as f:
            f.seek(3)
            byte = f.read(1)
            f.seek(3)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(PayloadError):
            sizes = [b.nbytes for b in manifest.buckets]
            verified_tensors(manifest, shared_memory.read_buffers(os.getpid(), fd, sizes))
    finally:
        os.close(fd)
    with pytest.raises(shared_memory.SegmentError, match="sender is gone"):
        shared_memory.read_buffers(os.getpid(), fd, [1])


def test_a_replica_on_another_shared_base_refuses_a_memory_file_handoff() -> None:
    manifest, _ = manifest_of(adapter())
    manifest.transport.shared_memory.CopyFrom(common_pb2.SharedMemoryTransport(colocation_id="boot:1:2", pid=1, fd=3))
    for own in ("", "boot:1:9"):
        agent = SimpleNamespace(colocation_id=own)
        with pytest.raises(StageError, match="reached a replica on"):
            WeightSyncAgent._receive_shared_memory(agent, manifest)


def replica(rid: str, colocation_id: str = "", **kw) -> Replica:
    capabilities = caps(**kw)
    capabilities.colocation_id = colocation_id
    return Replica(rid, capabilities, "127.0.0.1", frozenset())


def test_only_a_replica_on_the_trainers_shared_base_that_serves_the_adapter_maps_the_trainers_file() -> None:
    manifest, _ = manifest_of(adapter())
    job = SimpleNamespace(job_id="job", mode=common_pb2.SYNC_MODE_ADAPTER, spec=SimpleNamespace(lora=lora_spec()))
    record = SimpleNamespace(manifest=manifest, adapter=manifest, version=1, durable=False)
    handle = common_pb2.SharedMemoryTransport(colocation_id="boot:1:2", pid=10, fd=7)
    replicas = [replica("mine", "boot:1:2"), replica("other", "boot:1:3"), replica("plain"),
                replica("small", "boot:1:2", rank=2)]  # serves rank 4 only merged: a merge would write the base
    plan = plan_publish(WeightSyncSettings(), job, record, replicas, "127.0.0.1", 29500, handle)
    kinds = {rid: m.transport for rid, m in plan.round.members.items()}
    assert kinds == {"mine": "shared_memory", "other": "collective", "plain": "collective", "small": "collective"}
    mapped = plan.round.members["mine"].stage
    assert mapped.manifest.transport.shared_memory == handle and mapped.serve_mode == common_pb2.SYNC_MODE_ADAPTER
    assert plan.trainer_manifest.transport.WhichOneof("kind") == "collective"  # the trainer still sends to the rest
    alone = plan_publish(WeightSyncSettings(), job, record, replicas[:1], "127.0.0.1", 29500, handle)
    assert alone.trainer_manifest.transport.WhichOneof("kind") == "shared_memory"  # no group formed for nobody
    unshared = plan_publish(WeightSyncSettings(), job, record, replicas[:1], "127.0.0.1", 29500)
    assert {m.transport for m in unshared.round.members.values()} == {"collective"}


def test_the_service_refuses_a_handoff_that_names_no_memory_file() -> None:
    from lorarl.common.errors import InvalidArgumentError
    from lorarl.weightsync.service.server import WeightSyncServicer

    manifest, _ = manifest_of(adapter())
    request = weightsync_pb2.PublishManifestRequest(manifest=manifest, shared_memory=common_pb2.SharedMemoryTransport(
        colocation_id="boot:1:2"))
    servicer = WeightSyncServicer.__new__(WeightSyncServicer)
    with pytest.raises(InvalidArgumentError, match="colocation_id, pid and fd are all required"):
        asyncio.run(servicer.PublishManifest(request, None))


def test_cuda_ipc_handles_are_checked_before_torch_sees_them() -> None:
    """What runs without a GPU of lorarl.platform.cuda_ipc (the GPU path: bench/one_base_gpu.py): a buffer it cannot
    share, a handle that is not one, and the exporter's own handle once its buffer is gone are refused by name."""
    from lorarl.platform import cuda_ipc

    with pytest.raises(ValueError, match=r"contiguous 1-D uint8 CUDA tensor, got torch\.uint8"):
        cuda_ipc.export_buffer(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a lorarl-cuda-ipc-1 handle"):
        cuda_ipc.open_buffer({"format": "pickle"})
    with pytest.raises(ValueError, match="exported the handle but no longer holds its buffer"):
        cuda_ipc.open_buffer({"format": cuda_ipc.FORMAT, "pid": os.getpid(), "handle": "gone"})
    with pytest.raises(ValueError, match="lacks 'size'"):
        cuda_ipc.open_buffer({"format": cuda_ipc.FORMAT, "pid": -1})
