"""Receiving a version in vLLM's worker vs in the rollout service, side by side on one engine (CPU, gloo).

`rollout.receive_in_worker` has the engine's worker join the weight-transfer group and receive into its
own device memory; the default on CPU receives in the service process (the weight-sync agent), which
then hands the tensors to the engine as safetensors bytes. This runs both on one vLLM engine (CPU,
fp32; its engine core in a process of its own as on GPUs, or with --in-process in this one) serving a
random-init model of Qwen3-0.6B's layer shapes (--layers decoder layers, full vocabulary),
for an all-linear rank-32 adapter and for the merged weights:

- the time from the sender starting its broadcast to the version staged in the engine (bytes on the
  gloo group, every checksum and keyed MAC verified, the adapter registered or the weights staged),
  best and median over --reps versions per path, the paths alternated version by version;
- after each staged version is committed, greedy tokens and their logprobs, which must be the same
  on both paths bit for bit (else the run fails).

The sender is a thread of this process on a real gloo group (the trainer is another process in a job);
both paths share that. On GPUs and NPUs the difference is larger by construction (the service's path
copies device -> host -> engine process -> device; the worker's copies once to the host, for checksums),
but that is not measured here: no accelerator was lent.

    .venv/bin/python bench/receive_in_worker.py              # 4 layers, 5 versions per path and mode
    .venv/bin/python bench/receive_in_worker.py --quick --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Weight sync: receiving in vLLM's worker vs in the rollout service"
PATHS = ("service", "worker")
RANK = 32
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def random_adapter(files: Any, layers: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(layers):
        for module in MODULES:
            name = f"model.layers.{layer}.{module}"
            rows, cols = files.shape(f"{name}.weight")
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(RANK, cols, generator=g) * 0.02
            out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(rows, RANK, generator=g) * 0.02
    return out


class Loop:
    """The rollout core on an event loop in a thread, as the service runs it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600)


def send_version(sink: Any, core_loop: Loop, path: str, job: str, version: int, tensors: dict[str, Any], mode: int,
                 fingerprint: str, lora: Any) -> float:
    """One version over a fresh gloo group; seconds from the sender's first broadcast to the version staged."""
    from lorarl.weightsync.client.agent import verify_pieces
    from lorarl.weightsync.client.sinks import PolicyUpdate
    from lorarl.weightsync.wire.collective import WeightTransferGroup, rendezvous_store
    from lorarl.weightsync.wire.payload import build_manifest, pack, transfer_key

    key = transfer_key("bench", job)
    buckets = list(pack(sorted(tensors.items())))
    manifest = build_manifest(job_id=job, version=version, mode=mode, base_model_fingerprint=fingerprint,
                              buckets=buckets, lora=lora, key=key)
    store = rendezvous_store("127.0.0.1", 120)
    group_name = f"{job}-{version}"
    done: dict[str, Any] = {}

    def receive() -> None:
        try:
            if path == "worker":
                rendezvous = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": store.port, "rank": 1,
                              "world_size": 2, "group_name": group_name, "source_rank": 0, "timeout_s": 120.0,
                              "local_address": "127.0.0.1"}
                received = sink.receive_in_engine(manifest, rendezvous, key, mode)
                assert received is not None, "the engine did not receive in its worker"
            else:  # what the weight-sync agent does (WeightSyncAgent._receive_collective)
                group = WeightTransferGroup("gloo", "127.0.0.1", store.port, 1, 2, group_name, timeout_s=120,
                                            local_address="127.0.0.1")
                try:
                    received = verify_pieces(manifest, group.receive_pieces([b.nbytes for b in manifest.buckets]),
                                             key=key)
                finally:
                    group.close(wait=False)
            sink.stage(PolicyUpdate(manifest, received, mode))
            done["t"] = time.perf_counter()
        except BaseException as exc:  # reported by the caller
            done["error"] = exc

    receiver = threading.Thread(target=receive)
    receiver.start()
    sender = WeightTransferGroup("gloo", "127.0.0.1", store.port, 0, 2, group_name, timeout_s=120, store=store,
                                 local_address="127.0.0.1")
    started = time.perf_counter()
    sender.send(iter(buckets))
    receiver.join(600)
    sender.close()
    if "error" in done:
        raise done["error"]
    sink.commit(job, version)
    return done["t"] - started


def greedy(core_loop: Loop, core: Any, job: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    from lorarl.rollout.schema import GenerateInput, PolicyRef, Sampling

    [result] = core_loop.call(core.generate(GenerateInput(f"greedy-{job}-{time.monotonic_ns()}", (tuple(prompt),),
                                                          Sampling(temperature=0.0, max_tokens=16, ignore_eos=True),
                                                          PolicyRef(job))))
    completion = result.completions[0]
    return list(completion.token_ids), list(completion.logprobs)


def run(args: argparse.Namespace) -> list[str]:
    import torch

    from lorarl.assets.models import build_random_model
    from lorarl.contract.fingerprint import base_model_fingerprint
    from lorarl.contract.lora import LoraSpec
    from lorarl.rollout.config import RolloutSettings
    from lorarl.rollout.factory import start_core
    from lorarl.rollout.model_files import ModelFiles
    from lorarl.rollout.payloads import complete_weights, merge_adapter
    from lorarl.rollout.sink import RolloutSink
    from lorarl.v1 import common_pb2

    tmp = Path(tempfile.mkdtemp(prefix="lorarl-recv-bench-"))
    build_random_model("qwen3-0.6b", tmp, num_layers=args.layers, dtype=torch.float32)
    files = ModelFiles(tmp)
    fingerprint = base_model_fingerprint(tmp)
    lora = LoraSpec(rank=RANK, alpha=2 * RANK, target_modules=tuple(m.rsplit(".", 1)[-1] for m in MODULES))
    settings = RolloutSettings(model_path=str(tmp), engine="vllm", dtype="float32", max_model_len=256,
                               kv_cache_gib=0.5, max_loras=4, max_lora_rank=RANK, receive_in_worker="on")
    core_loop = Loop()
    core = core_loop.call(start_core(settings))
    client = type(core.engine.llm.engine_core).__name__  # which engine-core client ran (in-process or not)
    sink = RolloutSink(core, core_loop.loop)
    prompt = [11, 22, 33, 44, 55, 66, 77, 88]
    modes = {"adapter": common_pb2.SYNC_MODE_ADAPTER, "merged": common_pb2.SYNC_MODE_MERGED}
    times: dict[tuple[str, str], list[float]] = {(m, p): [] for m in modes for p in PATHS}
    sizes: dict[str, int] = {}
    try:
        for rep in range(args.reps + 1):  # version 1 of each job: warm-up, not timed
            adapter = random_adapter(files, args.layers, seed=rep)
            payloads = {"adapter": adapter, "merged": dict(complete_weights(merge_adapter(adapter, lora, files),
                                                                            files))}
            for mode, wire in modes.items():
                sizes[mode] = sum(t.nbytes for t in payloads[mode].values())
                outputs = {}
                for path in (PATHS if rep % 2 == 0 else PATHS[::-1]):
                    job = f"{mode}-{path}"
                    seconds = send_version(sink, core_loop, path, job, rep + 1, payloads[mode], wire, fingerprint,
                                           common_pb2.LoraSpec(rank=RANK, alpha=2 * RANK) if mode == "adapter"
                                           else None)
                    if rep:
                        times[(mode, path)].append(seconds)
                    outputs[path] = greedy(core_loop, core, job, prompt)
                    if mode == "merged":  # one merged job at a time: the engine's own weights
                        core_loop.call(core.unload(job))
                if outputs["service"] != outputs["worker"]:
                    raise SystemExit(f"{mode} v{rep + 1}: the two paths serve different tokens or logprobs")
    finally:
        core_loop.call(core.close())
    lines = [f"Qwen3-0.6B shape, {args.layers} layers, fp32, vLLM CPU (engine-core client {client}), gloo on "
             "loopback; "
             f"{args.reps} versions per path and mode after a warm-up one; greedy tokens and logprobs identical "
             "on both paths after every version.", "",
             "| payload | MiB | service: best / median s | worker: best / median s | worker / service (median) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for mode in modes:
        svc, wrk = times[(mode, "service")], times[(mode, "worker")]
        lines.append(f"| {mode} | {sizes[mode] / 2**20:.0f} | {min(svc):.3f} / {statistics.median(svc):.3f} | "
                     f"{min(wrk):.3f} / {statistics.median(wrk):.3f} | "
                     f"{statistics.median(wrk) / statistics.median(svc):.2f}x |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 layer, 2 versions per path")
    parser.add_argument("--in-process", action="store_true",
                        help="vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as `make demo`)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.reps = 1, 2
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.in_process else "1"
    lines = run(args)
    print("\n".join(lines))
    if not args.no_write:
        from bench.results import write_results

        where = "engine core in-process" if args.in_process else "engine core in its own process"
        write_results(HEADING, f"### {args.layers} layers, {args.reps} versions, {where} "
                               f"({time.strftime('%Y-%m-%d')})", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
