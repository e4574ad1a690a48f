"""A rollout replica for tests, as its own process: a WeightSyncAgent over an in-memory or model sink.

Writes one JSON line per event to --events (subscribed, stage, commit, abort, with digests of the
staged tensors and, for the model sink, the logits after each commit). Fault flags make it flip a
byte, truncate a bucket, or die in the middle of receiving a given version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading

import torch
import xxhash

from lorarl.v1 import common_pb2, weightsync_pb2
from lorarl.weightsync.client.agent import WeightSyncAgent
from lorarl.weightsync.client.sinks import InMemorySink, PolicyUpdate


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh64()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Recorder:
    """Wraps a sink and appends what happens to a JSON-lines file."""

    def __init__(self, inner, path: str) -> None:
        self.inner, self.path, self.lock = inner, path, threading.Lock()

    def write(self, **entry) -> None:
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    def active_versions(self) -> dict[str, int]:
        return self.inner.active_versions()

    def stage(self, update: PolicyUpdate) -> None:
        self.inner.stage(update)
        self.write(event="stage", job=update.job_id, version=update.version, serve_mode=update.serve_mode,
                   manifest_mode=update.manifest.mode, digest=tensors_digest(update.tensors),
                   transport=update.manifest.transport.WhichOneof("kind"),
                   master=update.manifest.transport.collective.master_address)

    def commit(self, job_id: str, version: int) -> None:
        self.inner.commit(job_id, version)
        entry = {"event": "commit", "job": job_id, "version": version}
        if hasattr(self.inner, "logits"):
            entry["logits"] = self.inner.logits().tolist()
        self.write(**entry)

    def abort(self, job_id: str, version: int) -> None:
        self.inner.abort(job_id, version)
        self.write(event="abort", job=job_id, version=version)


def fault_hook(args: argparse.Namespace):
    def hook(manifest: common_pb2.WeightManifest, index: int, piece: torch.Tensor) -> torch.Tensor:
        if manifest.version == args.corrupt_version and index == 0:
            piece[piece.numel() // 2] ^= 0x40  # damage the received bytes in place
        if manifest.version == args.truncate_version and index == len(manifest.buckets) - 1:
            piece = piece[:-16]  # the last bytes never arrive
        if manifest.version == args.die_version and index == 0:
            os._exit(3)  # a replica dying in the middle of a transfer
        return piece

    return hook


async def main(args: argparse.Namespace) -> None:
    if args.sink == "model":
        from tests.integration.weightsync.tiny import ModelSink

        inner = ModelSink()
    else:
        inner = InMemorySink()
    sink = Recorder(inner, args.events)
    caps = weightsync_pb2.ReplicaCapabilities(supports_lora=args.lora, max_lora_rank=64, max_loras=4,
                                              engine=args.engine, base_model_fingerprint=args.fingerprint)
    if not args.inline_only:
        caps.collective_backends.append(common_pb2.COLLECTIVE_BACKEND_GLOO)
    agent = WeightSyncAgent(args.target, sink, replica_id=args.replica_id, capabilities=caps, job_ids=args.job,
                            host=args.host, token=os.environ.get("LORARL_AUTH_TOKEN"), reconnect_max_s=1.0,
                            receive_hook=fault_hook(args))
    task = asyncio.create_task(agent.run())
    seen = 0
    while not task.done():
        if agent.subscriptions > seen:
            seen = agent.subscriptions
            sink.write(event="subscribed", count=seen, host=agent.host)
        await asyncio.sleep(0.05)
    await task


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--sink", choices=["memory", "model"], default="memory")
    parser.add_argument("--job", action="append", default=[])
    parser.add_argument("--host")
    parser.add_argument("--engine", default="test")
    parser.add_argument("--fingerprint", default="")
    parser.add_argument("--no-lora", dest="lora", action="store_false")
    parser.add_argument("--inline-only", action="store_true")
    parser.add_argument("--corrupt-version", type=int, default=-1)
    parser.add_argument("--truncate-version", type=int, default=-1)
    parser.add_argument("--die-version", type=int, default=-1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main(parser.parse_args()))
