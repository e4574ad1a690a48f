"""The rollout service for integration tests: a real core and gRPC server on a loop in a background thread.

Tests talk to it with blocking stubs (concurrency through `stub.X.future`) and reach the core with
`harness.call(coroutine)`. Also: LoadWeights streams from tensors, and transformers(+PEFT) references.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from lorarl.common.channel import sync_channel
from lorarl.common.server_config import AuthConfig, ServerConfig
from lorarl.contract.lora import LoraSpec
from lorarl.rollout.client import load_weights_stream
from lorarl.rollout.config import RolloutServiceConfig, RolloutSettings
from lorarl.rollout.core import RolloutCore
from lorarl.rollout.factory import start_core
from lorarl.rollout.model_files import ModelFiles
from lorarl.rollout.payloads import complete_weights, merge_adapter
from lorarl.rollout.server import start_rollout
from lorarl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

T = TypeVar("T")
TOKEN = "rollout-test-token"


class RolloutHarness:
    def __init__(self, settings: RolloutSettings, server: ServerConfig | None = None) -> None:
        self.settings = settings
        self.server = server or ServerConfig(port=0, metrics_port=-1, shutdown_grace_s=0.5)
        self.server.auth = AuthConfig(token=TOKEN)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-harness", daemon=True)
        self.core: RolloutCore
        self.channel: grpc.Channel
        self.stub: rollout_pb2_grpc.RolloutServiceStub

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 600) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> RolloutHarness:
        self._thread.start()
        self.core = self.call(start_core(self.settings))
        config = RolloutServiceConfig(server=self.server, rollout=self.settings)
        self.running, _ = self.call(start_rollout(config, self.core))
        self.channel = sync_channel(self.running.address, token=TOKEN)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        return self

    def close(self) -> None:
        self.channel.close()
        self.call(self.running.stop(0))
        self.call(self.core.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def lora_spec(lora: LoraSpec) -> common_pb2.LoraSpec:
    return common_pb2.LoraSpec(rank=lora.rank, alpha=lora.alpha, use_rslora=lora.use_rslora)


def load_requests(job_id: str, version: int, tensors: Mapping[str, torch.Tensor], mode: int, fingerprint: str,
                  lora: LoraSpec | None = None, chunk_bytes: int = 1 << 20, corrupt: bool = False
                  ) -> Iterator[rollout_pb2.LoadWeightsRequest]:
    """A LoadWeights stream for these tensors; with `corrupt`, one byte of the first chunk is flipped."""
    spec = lora_spec(lora) if lora is not None else None
    for i, request in enumerate(load_weights_stream(job_id, version, tensors, mode, fingerprint, spec, chunk_bytes)):
        if corrupt and i == 1:
            data = bytearray(request.chunk.data)
            data[0] ^= 0xFF
            request.chunk.data = bytes(data)
        yield request


def merged_weights(model_dir: Path, adapter: Mapping[str, torch.Tensor], lora: LoraSpec,
                   extra: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every checkpoint weight with the adapter merged in (the trainer's arithmetic), plus `extra` overrides."""
    files = ModelFiles(model_dir)
    merged = merge_adapter(adapter, lora, files) if adapter else {}
    merged.update(extra or {})
    return dict(complete_weights(merged, files))


def save_checkpoint(model_dir: Path, weights: Mapping[str, torch.Tensor]) -> Path:
    """A copy of `model_dir` (config, tokenizer) with these weights, for transformers references."""
    from safetensors.torch import save_file

    out = Path(tempfile.mkdtemp(prefix="lorarl-rollout-ref-"))
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@torch.no_grad()
def reference_greedy(model_dir: Path, prompt: tuple[int, ...], max_new: int,
                     adapter: Mapping[str, torch.Tensor] | None = None, lora: LoraSpec | None = None
                     ) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers (+ PEFT for an adapter), fp32, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        assert lora is not None
        targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapter})
        model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets,
                                                 use_rslora=lora.use_rslora, lora_dropout=0.0))
        result = set_peft_model_state_dict(model, dict(adapter))
        assert not result.unexpected_keys, result.unexpected_keys
        model.eval()
    ids = list(prompt)
    tokens, logprobs = [], []
    past = None
    step = ids
    for _ in range(max_new):
        out = model(input_ids=torch.tensor([step]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        lp = torch.log_softmax(out.logits[0, -1].float(), -1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        step = [token]
    return tokens, logprobs


def greedy(max_tokens: int, **extra: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def generate(stub: rollout_pb2_grpc.RolloutServiceStub, prompt: tuple[int, ...], sampling: common_pb2.SamplingParams,
             job_id: str = "", version: int = 0, timeout: float = 120) -> rollout_pb2.Completion:
    response = stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=prompt)], sampling=sampling,
        policy=rollout_pb2.PolicySelector(job_id=job_id, version=version)), timeout=timeout)
    return response.results[0].completions[0]


def send_in_worker(service: RolloutHarness, job: str, tensors: Mapping[str, torch.Tensor], mode: int,
                   serve_mode: int, fingerprint: str, ranks: tuple[int, ...] = (1,)) -> str:
    """One version over a real gloo transfer group, received by the engine's workers themselves with
    ``ranks`` (one per worker; the sender here is rank 0), then staged and committed through the
    weight-sync sink; returns the receive token."""
    from lorarl.rollout.sink import RolloutSink
    from lorarl.weightsync.client.sinks import PolicyUpdate
    from lorarl.weightsync.wire.collective import WeightTransferGroup, rendezvous_store
    from lorarl.weightsync.wire.payload import build_manifest, pack, transfer_key

    key = transfer_key("in-worker", job)
    buckets = list(pack(sorted(tensors.items()), bucket_bytes=4 << 20))
    lora = common_pb2.LoraSpec(rank=8, alpha=16) if mode == common_pb2.SYNC_MODE_ADAPTER else None
    manifest = build_manifest(job_id=job, version=1, mode=mode, base_model_fingerprint=fingerprint, buckets=buckets,
                              lora=lora, key=key)
    store = rendezvous_store("127.0.0.1", 60)
    world = 1 + len(ranks)
    rendezvous = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": store.port, "ranks": list(ranks),
                  "world_size": world, "group_name": f"{job}-1", "source_rank": 0, "timeout_s": 60.0,
                  "local_address": "127.0.0.1"}
    sink = RolloutSink(service.core, service.loop)
    got: dict[str, object] = {}
    receiver = threading.Thread(target=lambda: got.update(t=sink.receive_in_engine(manifest, rendezvous, key,
                                                                                    serve_mode)))
    receiver.start()
    sender = WeightTransferGroup("gloo", "127.0.0.1", store.port, 0, world, f"{job}-1", timeout_s=60, store=store,
                                 local_address="127.0.0.1")
    sender.send(iter(buckets))
    receiver.join(120)
    sender.close()
    received = got["t"]
    assert received is not None and received.engine_token  # type: ignore[attr-defined]
    assert all(t.is_meta for t in received.values()) and received.keys() == tensors.keys()  # type: ignore[union-attr]
    token = received.engine_token  # type: ignore[attr-defined]
    try:
        sink.stage(PolicyUpdate(manifest, received, serve_mode))  # type: ignore[arg-type]
    finally:  # staged or refused, the worker holds no received buffers any more
        assert service.call(service.core.engine.llm.collective_rpc(
            "lorarl_drop_received", kwargs={"token": token})) == [False] * len(ranks)
    sink.commit(job, 1)
    return token


def field_of(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get("lorarl-field")


@contextlib.contextmanager
def openai_served(model_dir: Path) -> Iterator[tuple[RolloutHarness, Any]]:
    """A vLLM rollout on ``model_dir`` with its OpenAI-compatible endpoint on a free loopback port."""
    from lorarl.rollout.openai.http_server import start_openai_server

    settings = RolloutSettings(model_path=str(model_dir), engine="vllm", dtype="float32", max_model_len=512,
                               kv_cache_gib=0.5, max_loras=2, adapter_window=1)
    harness = RolloutHarness(settings).start()
    server = harness.call(start_openai_server(harness.core, "127.0.0.1", 0, TOKEN))
    try:
        yield harness, server
    finally:
        harness.call(server.stop())
        harness.close()
