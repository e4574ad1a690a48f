"""Weight-sync benchmark: publishing an adapter vs merged weights, side by side, on Qwen3-0.6B shapes.

Builds a random-init model with Qwen3-0.6B's shapes (hidden 1024, intermediate 3072, 16 heads,
8 KV heads, head_dim 128, vocab 151936, tied embeddings; bf16 like the released checkpoint; layers
reduced by ``--layers``) in memory from a Qwen3Config, never downloading anything. For each LoRA
rank it injects all-linear adapters (lorarl/trainer/rl/lora.py, B made non-zero) and registers two
jobs on a real weight-sync service process (`lorarl serve weightsync`): one ADAPTER, one MERGED.
Replicas are real agent processes whose sink materialises (copies) every received tensor.

Measured per job, over several versions after one warm-up version (best of, as on a shared machine
the minimum is the least disturbed): bytes moved (the payload each replica receives
over the gloo group, plus the durable adapter uploaded to the service) and the time from "trainer
step done" (publish called) to "rollout serving the new version" (every replica reported active).
Transport efficiency: bytes/s of WeightTransferGroup.send with the receiver's verification, vs a
raw torch.distributed broadcast of the same buckets on the same kind of group, alternated.

With fewer layers the embedding (151936 x 1024) dominates the merged bytes, so the byte ratio is
also extrapolated to the real 28 layers by formula (fixed + per-layer bytes), labelled as such.

    .venv/bin/python bench/weightsync_adapter_vs_merged.py               # 4 layers, ranks 16 and 64
    .venv/bin/python bench/weightsync_adapter_vs_merged.py --layers 28
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
HEADING = "## Weight sync: adapter vs merged"
BYTES_TARGET = 0.02
TIME_TARGET = 0.1
TRANSPORT_TARGET = 0.7
REAL_LAYERS = 28
TOKEN = "bench-weightsync-token"
FINGERPRINT = "sha256:bench-qwen3-0.6b-shaped"


def qwen3_06b_config(layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_base(layers: int) -> torch.nn.Module:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(qwen3_06b_config(layers)).to(torch.bfloat16).eval()


def lora_model(base: torch.nn.Module, rank: int) -> torch.nn.Module:
    from lorarl.trainer.rl.lora import LoraConfig, inject_lora, lora_parameters

    model = copy.deepcopy(base)
    inject_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return model


# ------------------------------------------------------------------------------------------ processes


def start_service(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    from lorarl.common.ready import wait_for_ready_file

    config = tmp / "weightsync.yaml"
    config.write_text(json.dumps({"server": {"port": 0, "metrics_port": -1, "shutdown_grace_s": 0.5},
                                  "weightsync": {"storage_dir": str(tmp / "ws")}}))
    ready = tmp / "ready.json"
    env = {**os.environ, "LORARL_AUTH_TOKEN": TOKEN}
    process = subprocess.Popen([sys.executable, "-m", "lorarl.client.cli", "serve", "weightsync",
                                "--config", str(config), "--ready-file", str(ready), "--log-level", "warning"],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return process, wait_for_ready_file(ready, timeout=60, process=process)["address"]


def start_agent(target: str, replica_id: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "LORARL_AUTH_TOKEN": TOKEN}
    return subprocess.Popen([sys.executable, __file__, "--agent", target, "--replica-id", replica_id], cwd=ROOT,
                            env=env)


async def run_agent(target: str, replica_id: str) -> None:
    """A replica whose sink copies every tensor it is given (what loading into an engine costs at least)."""
    from lorarl.v1 import common_pb2, weightsync_pb2
    from lorarl.weightsync.client.agent import WeightSyncAgent
    from lorarl.weightsync.client.sinks import InMemorySink

    caps = weightsync_pb2.ReplicaCapabilities(supports_lora=True, max_lora_rank=256, max_loras=8, engine="bench",
                                              collective_backends=[common_pb2.COLLECTIVE_BACKEND_GLOO])
    agent = WeightSyncAgent(target, InMemorySink(), replica_id=replica_id, capabilities=caps, token=TOKEN)
    await agent.run()


# ------------------------------------------------------------------------------------------- sync runs


def adapter_payload(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from lorarl.trainer.rl.lora import peft_state_dict

    return {n: t.to(getattr(torch, args.adapter_dtype)) for n, t in peft_state_dict(model).items()}


async def measure_sync(target: str, base: torch.nn.Module, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    from lorarl.trainer.rl.lora import iter_merged_weights
    from lorarl.v1 import common_pb2
    from lorarl.weightsync.client.publisher import WeightPublisher
    from lorarl.weightsync.wire.catalog import catalog_from_tensors

    catalog = catalog_from_tensors(iter_merged_weights(base, merge=False))  # the same for every rank
    modes = (("adapter", common_pb2.SYNC_MODE_ADAPTER), ("merged", common_pb2.SYNC_MODE_MERGED))
    results: dict[int, dict[str, Any]] = {}
    async with WeightPublisher(target, token=TOKEN, bucket_bytes=args.bucket_mib << 20) as pub:
        for rank in args.ranks:
            lora = common_pb2.LoraSpec(rank=rank, alpha=2.0 * rank, target_modules=["all-linear"])
            for mode_name, mode in modes:
                await pub.register_job(f"{mode_name}-r{rank}", base_model_fingerprint=FINGERPRINT, lora=lora,
                                       catalog=catalog, mode=mode)
        deadline = time.monotonic() + 120
        while True:  # every replica must be subscribed, or the rounds would not include it
            status = (await pub.status(f"adapter-r{args.ranks[0]}")).jobs[0]
            if sum(r.connected for r in status.replicas) >= args.replicas:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("replicas did not subscribe")
            await asyncio.sleep(0.2)
        for rank in args.ranks:
            model = lora_model(base, rank)
            per_mode: dict[str, Any] = {}
            for mode_name, _ in modes:
                job = f"{mode_name}-r{rank}"
                runs = []
                for version in range(1, args.versions + 2):  # version 1 warms up (first group, first files)
                    with torch.no_grad():  # a "training step": the adapter changes
                        for name, p in model.named_parameters():
                            if "lora_b" in name:
                                p.mul_(1.01)
                    result = await pub.publish(job, version, adapter=lambda m=model: adapter_payload(m, args),
                                               merged=lambda m=model: iter_merged_weights(m), timeout_s=600)
                    if not result.activation.ok:
                        raise RuntimeError(f"{job} v{version}: {result.activation.error}")
                    if version == 1:
                        continue
                    runs.append({"seconds": result.timings["total_s"], "payload": result.payload_bytes,
                                 "uploaded": result.uploaded_bytes, "receivers": result.receivers,
                                 "transport": result.transport, "timings": result.timings})
                    phases = " ".join(f"{k.removesuffix('_s')}={v:.3f}" for k, v in result.timings.items())
                    print(f"  {job} v{version}: {result.payload_bytes:,} B to {result.receivers} replica(s) over "
                          f"{result.transport}; {phases}", flush=True)
                per_mode[mode_name] = {"runs": runs, "seconds": min(r["seconds"] for r in runs),
                                       "payload": runs[-1]["payload"], "uploaded": runs[-1]["uploaded"],
                                       "receivers": runs[-1]["receivers"]}
            results[rank] = per_mode
            del model
    return results


# ------------------------------------------------------------------------------------ transport compare


def transport_peer(port: int, manifest_path: str, reps: int) -> None:
    """Rank 1 of the transport comparison: receives with our path (xxh64 + keyed hash, as the agent does),
    with xxh64 only (the check before keyed hashes), and raw, alternately."""
    from lorarl.v1 import common_pb2
    from lorarl.weightsync.client.agent import verified_tensors
    from lorarl.weightsync.wire.collective import WeightTransferGroup
    from lorarl.weightsync.wire.payload import transfer_key

    manifest = common_pb2.WeightManifest.FromString(Path(manifest_path).read_bytes())
    sizes = [b.nbytes for b in manifest.buckets]
    key = transfer_key(TOKEN, manifest.job_id)
    group = WeightTransferGroup("gloo", "127.0.0.1", port, 1, 2, "bench", timeout_s=600, local_address="127.0.0.1")
    for _ in range(reps):
        for check in (key, None):
            group.barrier()
            verified_tensors(manifest, group.receive_all(sizes), key=check)
            group.barrier()
        group.barrier()
        buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        for work in [group.broadcast(b, 0) for b in buffers]:
            work.wait()
        group.barrier()
    group.close()


def measure_transport(model: torch.nn.Module, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    from lorarl.trainer.rl.lora import iter_merged_weights
    from lorarl.weightsync.wire.collective import WeightTransferGroup
    from lorarl.weightsync.wire.payload import bucket_mac, build_manifest, checksum, pack, transfer_key

    buckets = list(pack(iter_merged_weights(model), args.bucket_mib << 20))
    key = transfer_key(TOKEN, "bench")
    manifest = build_manifest(job_id="bench", version=1, mode=2, base_model_fingerprint="f", buckets=buckets,
                              key=key)
    hashes: dict[str, list[float]] = {"xxh64": [], "mac": []}  # each side's cost per byte, alternated
    for _ in range(args.transport_reps):
        for name, digest in (("xxh64", lambda b: checksum(b.buffer)),
                             ("mac", lambda b: bucket_mac(key, 1, 2, b.index, b.buffer))):
            t0 = time.perf_counter()
            for bucket in buckets:
                digest(bucket)
            hashes[name].append(time.perf_counter() - t0)
    manifest_path = tmp / "transport-manifest.binpb"
    manifest_path.write_bytes(manifest.SerializeToString())
    from lorarl.weightsync.wire.collective import rendezvous_store

    store = rendezvous_store("127.0.0.1", 600)
    peer = subprocess.Popen([sys.executable, __file__, "--transport-peer", str(store.port), str(manifest_path),
                             str(args.transport_reps)], cwd=ROOT)
    group = WeightTransferGroup("gloo", "127.0.0.1", store.port, 0, 2, "bench", timeout_s=600,
                                local_address="127.0.0.1", store=store)
    ours, xxh_only, raw = [], [], []
    try:
        for _ in range(args.transport_reps):
            for times in (ours, xxh_only):
                group.barrier()
                t0 = time.perf_counter()
                group.send(iter(buckets))
                group.barrier()  # the receiver has verified everything
                times.append(time.perf_counter() - t0)
            group.barrier()
            t0 = time.perf_counter()
            for work in [group.broadcast(b.buffer, 0) for b in buckets]:
                work.wait()
            group.barrier()
            raw.append(time.perf_counter() - t0)
    finally:
        group.close()
        peer.wait(timeout=120)
    nbytes = manifest.total_bytes
    return {"bytes": nbytes, "buckets": len(buckets), "ours_s": min(ours), "raw_s": min(raw),
            "ours_bps": nbytes / min(ours), "raw_bps": nbytes / min(raw), "xxh_only_bps": nbytes / min(xxh_only),
            "xxh64_hash_bps": nbytes / min(hashes["xxh64"]), "mac_hash_bps": nbytes / min(hashes["mac"])}


# ----------------------------------------------------------------------------------------------- report


def split_bytes(base: torch.nn.Module, rank: int, element_size: int) -> tuple[int, int, int]:
    """(bytes outside the layers, merged bytes per layer, adapter bytes per layer) for the formula."""
    from lorarl.trainer.rl.lora import iter_merged_weights

    fixed = per_layer = 0
    layers = base.config.num_hidden_layers
    for name, t in iter_merged_weights(base, merge=False):
        n = t.numel() * t.element_size()
        if ".layers." in f".{name}":
            per_layer += n
        else:
            fixed += n
    h, i = base.config.hidden_size, base.config.intermediate_size
    q = base.config.num_attention_heads * base.config.head_dim
    kv = base.config.num_key_value_heads * base.config.head_dim
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]  # q k v o gate up down: (out, in)
    adapter_per_layer = sum(rank * (o + n) for o, n in shapes) * element_size
    return fixed, per_layer // layers, adapter_per_layer


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def verdict(value: float, target: float, at_most: bool = True) -> str:
    return "PASS" if (value <= target if at_most else value >= target) else "FAIL"


def report(args: argparse.Namespace, base: torch.nn.Module, sync: dict[int, dict[str, Any]],
           transport: dict[str, float]) -> tuple[list[str], bool]:
    lines = [
        f"Qwen3-0.6B shapes with {args.layers} of {REAL_LAYERS} layers (random init, built locally), bf16 base, "
        f"{args.adapter_dtype} all-linear adapters; `lorarl serve weightsync` and {args.replicas} replica "
        f"process(es) whose sink copies every tensor, on {platform.machine()} with {os.cpu_count()} CPUs (load "
        f"average {os.getloadavg()[0]:.1f} at the end); gloo over loopback; bucket {args.bucket_mib} MiB; time = "
        f"publish called -> every replica reported active, best of {args.versions} versions after a warm-up one "
        f"(includes packing and checksums, the merge itself for merged, the durable adapter upload, and the "
        f"two-phase commit).",
        "",
        "| rank | metric | adapter | merged | adapter / merged | target | result |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    ok = True
    extrapolated = []
    for rank, modes in sync.items():
        a, m = modes["adapter"], modes["merged"]
        byte_ratio, time_ratio = a["payload"] / m["payload"], a["seconds"] / m["seconds"]
        ok &= byte_ratio <= BYTES_TARGET and time_ratio <= TIME_TARGET
        lines += [
            f"| {rank} | bytes to each replica | {mib(a['payload'])} | {mib(m['payload'])} | {byte_ratio:.2%} | "
            f"<= {BYTES_TARGET:.0%} | {verdict(byte_ratio, BYTES_TARGET)} |",
            f"| {rank} | publish -> serving | {a['seconds']:.3f} s | {m['seconds']:.3f} s | {time_ratio:.3f}x | "
            f"<= {TIME_TARGET}x | {verdict(time_ratio, TIME_TARGET)} |",
            f"| {rank} | durable adapter upload | {mib(a['uploaded'])} | {mib(m['uploaded'])} | | | |",
        ]
        element_size = torch.empty((), dtype=getattr(torch, args.adapter_dtype)).element_size()
        fixed, merged_layer, adapter_layer = split_bytes(base, rank, element_size)
        formula = (fixed + args.layers * merged_layer, args.layers * adapter_layer)
        for predicted, measured in zip(formula, (m["payload"], a["payload"]), strict=True):
            if abs(predicted - measured) > 0.001 * measured:  # only the 64-byte alignment padding may differ
                raise AssertionError(f"byte formula predicts {predicted:,} B, measured {measured:,} B")
        a28, m28 = REAL_LAYERS * adapter_layer, fixed + REAL_LAYERS * merged_layer
        # Time, extrapolated with a line through the two measured (bytes, seconds) points.
        slope = (m["seconds"] - a["seconds"]) / max(m["payload"] - a["payload"], 1)
        intercept = a["seconds"] - slope * a["payload"]
        t_a28, t_m28 = intercept + slope * a28, intercept + slope * m28
        extrapolated.append(
            f"| {rank} | {mib(a28)} | {mib(m28)} | {a28 / m28:.2%} ({verdict(a28 / m28, BYTES_TARGET)}) | "
            f"{t_a28:.2f} s | {t_m28:.2f} s | {t_a28 / t_m28:.3f}x ({verdict(t_a28 / t_m28, TIME_TARGET)}) |")
    efficiency = transport["ours_bps"] / transport["raw_bps"]
    ok &= efficiency >= TRANSPORT_TARGET
    lines += [
        f"| | transport: WeightTransferGroup.send + receiver verify vs raw broadcast "
        f"({mib(transport['bytes'])}, {transport['buckets']} bucket(s), best of {args.transport_reps}) | "
        f"{transport['ours_bps'] / 2**30:.2f} GiB/s | raw {transport['raw_bps'] / 2**30:.2f} GiB/s | "
        f"{efficiency:.2f} | >= {TRANSPORT_TARGET} | {verdict(efficiency, TRANSPORT_TARGET, at_most=False)} |",
        f"| | transport: receiver verifies xxh64 + keyed BLAKE3 (as the agent does) vs xxh64 only (before keyed "
        f"hashes), same send | {transport['ours_bps'] / 2**30:.2f} GiB/s | xxh64 only "
        f"{transport['xxh_only_bps'] / 2**30:.2f} GiB/s | {transport['ours_bps'] / transport['xxh_only_bps']:.2f} "
        f"| | |",
        f"| | hash alone, one pass over the buckets (each side pays it once: sender packing, receiver checking) "
        f"| keyed BLAKE3 {transport['mac_hash_bps'] / 2**30:.2f} GiB/s | xxh64 "
        f"{transport['xxh64_hash_bps'] / 2**30:.2f} GiB/s | "
        f"time {transport['xxh64_hash_bps'] / transport['mac_hash_bps']:.2f}x xxh64's | | |",
        "",
    ]
    if args.layers != REAL_LAYERS:
        lines += [
            f"EXTRAPOLATED to {REAL_LAYERS} layers by formula, not measured: bytes = (embedding + final norm) + "
            f"layers x (per-layer bytes), adapters = layers x rank x sum(in + out) x element size; times from a "
            f"straight line through the two measured (bytes, seconds) points above (a rough model: fixed costs + "
            f"bytes / rate).",
            "",
            "| rank | adapter bytes (extrap.) | merged bytes (extrap.) | bytes ratio (extrap.) | adapter time "
            "(extrap.) | merged time (extrap.) | time ratio (extrap.) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *extrapolated,
            "",
        ]
    lines.append(f"Command: `.venv/bin/python bench/weightsync_adapter_vs_merged.py{args_suffix(args)}`")
    return lines, ok


def args_suffix(args: argparse.Namespace) -> str:
    parts = []
    if args.layers != 4:
        parts.append(f"--layers {args.layers}")
    if args.replicas != 1:
        parts.append(f"--replicas {args.replicas}")
    if args.bucket_mib != 1024:
        parts.append(f"--bucket-mib {args.bucket_mib}")
    if args.adapter_dtype != "float32":
        parts.append(f"--adapter-dtype {args.adapter_dtype}")
    return (" " + " ".join(parts)) if parts else ""


def write_results(title: str, body: list[str]) -> None:
    """This run under its own sub-heading of this benchmark's section of bench/RESULTS.md."""
    from bench.results import write_results as write_section

    write_section(HEADING, title, body, RESULTS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help=f"decoder layers (Qwen3-0.6B has {REAL_LAYERS})")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--versions", type=int, default=3, help="timed versions per job, after a warm-up one")
    parser.add_argument("--adapter-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype the adapter is published in (the trainer keeps float32)")
    parser.add_argument("--bucket-mib", type=int, default=1024, help="bucket size (the publisher's default: 1 GiB)")
    parser.add_argument("--transport-reps", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    parser.add_argument("--replica-id", help=argparse.SUPPRESS)
    parser.add_argument("--transport-peer", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        asyncio.run(run_agent(args.agent, args.replica_id))
        return 0
    if args.transport_peer:
        port, path, reps = args.transport_peer
        transport_peer(int(port), path, int(reps))
        return 0

    started = time.perf_counter()
    print(f"building Qwen3-0.6B-shaped model with {args.layers} layers ...", flush=True)
    base = build_base(args.layers)
    with tempfile.TemporaryDirectory(prefix="lorarl-bench-ws-") as tmp_name:
        tmp = Path(tmp_name)
        service, target = start_service(tmp)
        agents = [start_agent(target, f"replica-{i}") for i in range(args.replicas)]
        try:
            sync = asyncio.run(measure_sync(target, base, args))
        finally:
            for process in [*agents, service]:
                process.terminate()
            for process in [*agents, service]:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
        print("transport efficiency ...", flush=True)
        transport = measure_transport(lora_model(base, args.ranks[0]), args, tmp)
    body, ok = report(args, base, sync, transport)
    title = f"### cpu, gloo, {args.layers} layers, {args.replicas} replica(s), {args.adapter_dtype} adapters"
    print("\n".join([HEADING, "", title, "", *body]))
    print(f"\n{'all targets met' if ok else 'some targets missed'}; took {time.perf_counter() - started:.0f} s")
    if not args.no_write:
        write_results(title, body)
        print(f"written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
