"""The trainer side for tests, as its own process: register a tiny job, wait for replicas, publish versions.

Writes a JSON summary to --out: the publisher's host and, per version, the outcome, transport,
receivers and bytes. Used where the trainer must run somewhere else (another network namespace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from lorarl.v1 import common_pb2
from lorarl.weightsync.client.publisher import WeightPublisher
from tests.integration.weightsync.tiny import FINGERPRINT, TinyTrainer, lora_spec

MODES = {"adapter": common_pb2.SYNC_MODE_ADAPTER, "merged": common_pb2.SYNC_MODE_MERGED}


async def main(args: argparse.Namespace) -> None:
    trainer = TinyTrainer()
    summary: dict = {"versions": []}
    async with WeightPublisher(args.target, token=os.environ.get("LORARL_AUTH_TOKEN"), bucket_bytes=16 << 10) as pub:
        summary["host"] = pub.host
        await pub.register_job(args.job, base_model_fingerprint=FINGERPRINT, lora=lora_spec(),
                               catalog=trainer.catalog(), mode=MODES[args.mode])
        deadline = time.monotonic() + 120
        while True:
            status = (await pub.status(args.job)).jobs[0]
            if sum(r.connected for r in status.replicas) >= args.replicas:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("replicas did not subscribe")
            await asyncio.sleep(0.1)
        for version in range(1, args.versions + 1):
            trainer.step(version)
            result = await pub.publish(args.job, version, adapter=trainer.adapter(), merged=trainer.merged,
                                       timeout_s=120)
            summary["versions"].append({
                "version": version, "outcome": result.activation.outcome_name, "error": result.activation.error,
                "transport": result.transport, "receivers": result.receivers, "bytes": result.payload_bytes,
                "send_error": result.send_error})
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--job", default="job")
    parser.add_argument("--mode", choices=sorted(MODES), default="adapter")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--versions", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
