"""One base (placement.colocate), held on a live vLLM CPU engine: the engine's parameters ARE the shared memory
file, and the trainer's modules are views of the same bytes, by construction and checked.

- every parameter of the served model lies in the shared mapping, and holds exactly what vLLM's own loader puts
  there from the checkpoint (its real ``load_weights`` run into scratch tensors as the oracle);
- a layout with q and k swapped is caught by that same comparison and by the trainer's own check at load
  (the negative case: a mapping that is shape-correct but wrong must not pass, unsloth-zoo #941);
- values written through the trainer's view of every projection (q, k, v, o, gate, up, down, norms, the
  embedding that is also the head) are what the engine computes with, where its loader would put them; values
  written through the engine's names are what the trainer's modules read;
- a trainer job trains steps on the shared base and its bytes do not change (sha256 before and after);
- the co-located rollout refuses a merged version (it would write the trainer's base) with FAILED_PRECONDITION.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lorarl.contract import base_layout, base_segment
from lorarl.contract.fingerprint import base_model_fingerprint
from lorarl.platform import shared_memory
from lorarl.rollout.config import RolloutSettings
from lorarl.rollout.vllm import engine as vllm_engine
from lorarl.trainer.engines.torch.engine import TorchEngine
from lorarl.trainer.engines.torch.shared_base import BaseRegistry, alias_base
from lorarl.v1 import common_pb2
from tests.integration.rollout.harness import RolloutHarness, load_requests
from tests.support import vllm_worker
from tests.unit.rollout.models import dense_model_dir
from tests.unit.trainer.engine_utils import make_spec, synthetic_batch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def engine_name(name: str) -> str:
    """The shared tensor's name of an engine parameter (LoRA wraps the fused layers: '.base_layer.')."""
    return name.replace(".base_layer.", ".")


def layout_mismatches(reference: dict[str, str], segment: base_segment.Segment) -> list[str]:
    """Engine parameters whose bytes in ``segment`` are not what vLLM's own loader puts there."""
    views = segment.views()
    return sorted(n for n, d in reference.items() if digest(views[engine_name(n)]) != d)


def built(model_dir: Path) -> int:
    fd = shared_memory.create()
    base_segment.build(fd, model_dir)
    return fd


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RolloutHarness, int, Path]]:
    """A co-located vLLM rollout on the tiny dense model, and the memory file it maps (this process holds it)."""
    model_dir = dense_model_dir()
    fd = built(model_dir)
    settings = RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="float32", max_model_len=256,
                               kv_cache_gib=0.25, enable_lora=True, shared_base=shared_memory.path_of(fd))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_engine, "EXTENSION_QUALNAME", vllm_worker.QUALNAME)
        service = RolloutHarness(settings).start()
    try:
        yield service, fd, model_dir
    finally:
        service.close()
        os.close(fd)


def rpc(service: RolloutHarness, method: str, **kwargs: object) -> dict:
    return service.call(service.core.engine.llm.collective_rpc(method, kwargs=kwargs))[0]


def test_every_served_parameter_is_the_shared_memory_and_holds_what_vllms_loader_puts_there(colocated) -> None:
    service, fd, model_dir = colocated
    storage = rpc(service, "lorarl_test_shared_storage")
    assert storage and all(storage.values()), [n for n, inside in storage.items() if not inside]
    reference = rpc(service, "lorarl_test_reference_digests", checkpoint=str(model_dir / "model.safetensors"))
    assert set(reference) == set(storage)
    segment = base_segment.open_segment(shared_memory.path_of(fd), base_model_fingerprint(model_dir))
    assert layout_mismatches(reference, segment) == []
    served = rpc(service, "lorarl_weights_digest")  # what the engine computes with, read in its own process
    assert served == reference


def test_a_layout_with_q_and_k_swapped_is_caught_by_the_engine_check_and_by_the_trainer(
        colocated, monkeypatch: pytest.MonkeyPatch) -> None:
    service, _, model_dir = colocated
    reference = rpc(service, "lorarl_test_reference_digests", checkpoint=str(model_dir / "model.safetensors"))
    monkeypatch.setitem(base_layout.PACKED, "qkv_proj", ("k_proj", "q_proj", "v_proj"))
    fd = built(model_dir)
    monkeypatch.undo()  # the trainer reads the bytes with the true layout: q's rows hold k, and k's hold q
    try:
        swapped = base_segment.open_segment(shared_memory.path_of(fd))
        wrong = layout_mismatches(reference, swapped)
        assert wrong and all("qkv_proj" in n for n in wrong), wrong
        index = base_segment.checkpoint_index(model_dir)
        true_layout = base_layout.layout({n: (shape, dtype) for n, (*_, shape, dtype) in index.items()},
                                         base_segment.tied_embeddings(model_dir))
        views = swapped.views()
        misread = SimpleNamespace(part_views=lambda: {p.checkpoint: views[t.name][p.start:p.stop]
                                                      for t in true_layout for p in t.parts})
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with pytest.raises(ValueError, match=r"q_proj|k_proj") as info:
            alias_base(model, misread)
        assert "v_proj" not in str(info.value) and "o_proj" not in str(info.value)
    finally:
        os.close(fd)


def test_writes_through_either_sides_names_are_what_the_other_side_reads(colocated, tmp_path: Path) -> None:
    service, fd, model_dir = colocated
    segment = base_segment.open_segment(shared_memory.path_of(fd), writable=True)
    saved = {name: view.clone() for name, view in segment.views().items()}
    try:
        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        assert alias_base(trainer, segment) == len(list(trainer.parameters()))
        # trainer -> engine: a distinct value through every parameter of the trainer's modules
        params = dict(trainer.named_parameters())
        for i, (_, param) in enumerate(sorted(params.items())):
            param.data.fill_(float(i + 1))  # the mapping is writable here only: a service maps it read-only
        projections = {n.rsplit(".", 2)[-2] for n in params}
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                "q_norm", "k_norm"} <= projections
        checkpoint = tmp_path / "written.safetensors"
        save_file({n: p.detach().clone() for n, p in params.items()}, str(checkpoint))
        expected = rpc(service, "lorarl_test_reference_digests", checkpoint=str(checkpoint))
        assert rpc(service, "lorarl_weights_digest") == expected
        # engine -> trainer: a distinct value through every engine parameter's name; each trainer module reads
        # the value of the engine parameter its layout puts it in
        views = segment.views()
        for i, name in enumerate(sorted(views)):
            views[name].fill_(-float(i + 1))
        order = {name: -float(i + 1) for i, name in enumerate(sorted(views))}
        for name, param in trainer.named_parameters():
            target, _ = base_layout.shared_name(name)
            assert torch.all(param == order[target]), name
    finally:
        for name, view in segment.views().items():
            view.copy_(saved[name])
    assert rpc(service, "lorarl_weights_digest") == rpc(
        service, "lorarl_test_reference_digests", checkpoint=str(model_dir / "model.safetensors"))


def test_training_on_the_shared_base_never_writes_it(colocated) -> None:
    _, fd, model_dir = colocated
    path = shared_memory.path_of(fd)
    before = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    engine = TorchEngine(make_spec(model_dir, device="cpu"), bases=BaseRegistry(path))
    try:
        segment = engine.model.lorarl_segment  # the trainer's mapping: its base parameters lie in it
        start = torch.frombuffer(segment.buffer, dtype=torch.uint8, count=1).data_ptr()
        frozen = [p for p in engine.model.parameters() if not p.requires_grad]
        assert frozen and all(start <= p.data_ptr() < start + segment.nbytes for p in frozen)
        adapter = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
        for step in range(3):
            engine.train_step(synthetic_batch(step, version=engine.version))
        trained = {n: p for n, p in engine.model.named_parameters() if p.requires_grad}
        assert any(not torch.equal(adapter[n], trained[n]) for n in adapter)  # the adapter did train
    finally:
        engine.close()
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == before


def test_a_merged_version_is_refused_by_the_co_located_rollout(colocated) -> None:
    service, _, model_dir = colocated
    tensors = load_file(model_dir / "model.safetensors")
    with pytest.raises(grpc.RpcError) as info:
        service.stub.LoadWeights(load_requests("job", 1, tensors, common_pb2.SYNC_MODE_MERGED,
                                               base_model_fingerprint(model_dir)), timeout=120)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "co-located trainer's shared copy" in info.value.details()
