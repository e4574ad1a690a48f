"""A flooding tenant on the Tinker front beside a quiet one: the quiet tenant's sampling latency alone, beside a
flood that the flooding tenant's own limit holds back (tinker.tenants[].max_in_flight), and beside the same flood
with no such limit — side by side, on one stack, in one run.

`lorarl tinker`'s stack for the demo job (its vLLM rollout, or ``--engine hf``) with the Tinker front serving
three tenants: quiet (the default limits), held (``--limit`` requests running at once, the rest wait in its own
queue) and free (no effective limit). Each tenant samples the base model through a sampling session of its own.
A phase runs ``--calls`` quiet samples one after another (``--max-tokens`` tokens each, fixed seeds) while
``--flood`` concurrent clients of the flooding tenant, if any, keep asking for samples of the same size; the
quiet latency is from its asample POST to its retrieved result. Phases: alone, beside held, beside free, alone
again (the two alone phases pooled). Printed: median and 90th-percentile quiet latency, its ratio to alone (the
tenants issue's bar: at most 1.5x beside the held flood), and the flood's completed samples per second.

    .venv/bin/python bench/tenant_flood.py                 # vLLM rollout, ~4 min on 2 cores
    .venv/bin/python bench/tenant_flood.py --quick --no-write   # HF engine, few calls: a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Tinker front: a flooding tenant beside a quiet one"
#: The tenants issue's bar: the quiet tenant's median latency beside the held flood, against alone.
BAR = 1.5
#: A prompt of token ids inside the demo model's small vocabulary (264).
PROMPT = list(range(20, 44))


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    flood_done: int = 0
    flood_s: float = 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.latencies)

    @property
    def p90(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]

    @property
    def flood_rate(self) -> float:
        return self.flood_done / self.flood_s if self.flood_s else 0.0


def summary(phases: dict[str, Phase]) -> tuple[list[str], dict[str, float]]:
    """The table (alone pooled from its two phases) and each flooded phase's median ratio to alone."""
    alone = Phase("alone", phases["alone"].latencies + phases["alone again"].latencies)
    rows = [alone, phases["beside held flood"], phases["beside free flood"]]
    ratios = {p.name: p.median / alone.median for p in rows[1:]}
    lines = ["| quiet tenant | samples | median s | p90 s | median x alone | flood samples/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for p in rows:
        ratio = "1.00" if p is alone else f"{ratios[p.name]:.2f}"
        rate = f"{p.flood_rate:.1f}" if p.flood_s else "-"
        lines.append(f"| {p.name} | {len(p.latencies)} | {p.median:.3f} | {p.p90:.3f} | {ratio} | {rate} |")
    return lines, ratios


async def sample(client, api: str, session: str, max_tokens: int, seed: int) -> float:
    """One asample through the front, submit to result; seconds. A 429 waits its Retry-After, as the SDK does."""
    body = {"sampling_session_id": session, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed}}
    began = time.perf_counter()
    while (submitted := await client.post(f"{api}/asample", json=body)).status_code == 429:
        await asyncio.sleep(float(submitted.headers.get("retry-after", "1")))
    submitted.raise_for_status()
    request_id = submitted.json()["request_id"]
    while "protobuf" not in (got := await client.post(f"{api}/retrieve_future", json={
            "request_id": request_id})).headers["content-type"]:  # a sample's result is a protobuf SampleResponse
        if got.json().get("type") != "try_again":
            raise RuntimeError(f"a sample failed: {got.text}")
    return time.perf_counter() - began


async def run_phase(name: str, api: str, quiet: tuple, flood: tuple | None, args: argparse.Namespace) -> Phase:
    """``--calls`` quiet samples in turn, with ``--flood`` flooding clients beside them when ``flood`` is given;
    each (httpx client, sampling session id)."""
    phase = Phase(name)
    stop = asyncio.Event()

    async def flooder(index: int) -> None:
        client, session = flood
        while not stop.is_set():
            await sample(client, api, session, args.max_tokens, seed=10_000 + index)
            phase.flood_done += 1

    workers = [asyncio.create_task(flooder(i)) for i in range(args.flood)] if flood else []
    began = time.perf_counter()
    if workers:
        await asyncio.sleep(args.settle_s)  # the flood fills the engine (or the held queue) first
    client, session = quiet
    for i in range(args.calls):
        phase.latencies.append(await sample(client, api, session, args.max_tokens, seed=i))
    phase.flood_s = time.perf_counter() - began if workers else 0.0
    stop.set()
    await asyncio.gather(*workers)  # each finishes its sample in flight: the next phase starts unloaded
    print(f"{name}: quiet median {phase.median:.3f} s over {len(phase.latencies)}"
          + (f", flood {phase.flood_rate:.1f} samples/s" if workers else ""), flush=True)
    return phase


async def measure(front, keys: dict[str, str], args: argparse.Namespace) -> dict[str, Phase]:
    import httpx

    api = f"{front.base_url}/api/v1"
    limits = httpx.Limits(max_connections=args.flood + 8, max_keepalive_connections=args.flood + 8)
    clients = {name: httpx.AsyncClient(headers={"X-API-Key": key}, timeout=300, limits=limits)
               for name, key in keys.items()}
    try:
        sessions = {}
        for name, client in clients.items():  # a session and a sampling session on the base model each
            session = (await client.post(f"{api}/create_session", json={
                "tags": [], "user_metadata": None, "sdk_version": "bench"})).json()["session_id"]
            sessions[name] = (client, (await client.post(f"{api}/create_sampling_session", json={
                "session_id": session, "sampling_session_seq_id": 0, "base_model": front.base_model})).json()[
                "sampling_session_id"])
        await run_phase("warm-up", api, sessions["quiet"], None, argparse.Namespace(**{**vars(args), "calls": 2}))
        phases = {}
        for name, flood in (("alone", None), ("beside held flood", "held"), ("beside free flood", "free"),
                            ("alone again", None)):
            phases[name] = await run_phase(name, api, sessions["quiet"], sessions[flood] if flood else None, args)
        return phases
    finally:
        for client in clients.values():
            await client.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=24, help="quiet samples per phase")
    parser.add_argument("--flood", type=int, default=48, help="concurrent clients of the flooding tenant")
    parser.add_argument("--limit", type=int, default=2, help="the held tenant's max_in_flight")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--settle-s", type=float, default=3.0, help="flood alone before the quiet calls start")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="the rollout's engine")
    parser.add_argument("--quick", action="store_true", help="HF engine, 4 calls, 8 flooders (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if args.quick:
        args.engine, args.calls, args.flood, args.settle_s = "hf", 4, 8, 1.0

    from lorarl.client.launch.tinker import local_front
    from lorarl.tinker.tenants import FrontTenant, TenantLimits

    keys = {name: f"tml-{secrets.token_urlsafe(16)}" for name in ("held", "free")}
    tenants = [FrontTenant("held", (keys["held"],), TenantLimits(max_in_flight=args.limit, max_waiting=4096)),
               FrontTenant("free", (keys["free"],), TenantLimits(max_in_flight=4096, max_waiting=4096))]
    overrides = ["output.tensorboard=false", "output.progress=false", f"rollout.engine={args.engine}"]
    with tempfile.TemporaryDirectory(prefix="lorarl-tenant-flood-") as tmp, \
            local_front(ROOT / "examples/demo.yaml", [*overrides, f"output.dir={tmp}"], other_tenants=tenants) as front:
        keys["quiet"] = front.api_key
        phases = asyncio.run(measure(front, keys, args))
    lines, ratios = summary(phases)
    held = ratios["beside held flood"]
    verdict = (f"quiet median beside the held flood (max_in_flight {args.limit}): {held:.2f}x alone (bar {BAR}x: "
               f"{'PASS' if held <= BAR else 'FAIL'}); beside the same flood unheld: "
               f"{ratios['beside free flood']:.2f}x")
    print("\n".join(lines))
    print(verdict)
    if not args.no_write:
        from bench.results import write_results

        title = (f"### {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, {args.engine} "
                 f"rollout, {args.flood} flooding clients, {args.calls} quiet samples of {args.max_tokens} tokens "
                 "per phase")
        notes = ["", verdict, "",
                 "`lorarl tinker`'s stack for examples/demo.yaml with three tenants on its front; every sample is of",
                 "the base model through the front's HTTP API (asample, then retrieve_future), the quiet one's",
                 "latency from its POST to its result. 'held': the flooding tenant at max_in_flight "
                 f"{args.limit}, its other",
                 "requests waiting in its own queue at the front; 'free': the same flood with no effective limit, so",
                 "every request reaches the rollout at once and the quiet one queues behind them there."]
        write_results(HEADING, title, [*lines, *notes])
    return 0 if held <= BAR else 1


if __name__ == "__main__":
    raise SystemExit(main())
