"""Rollout throughput: the gRPC service vs the raw vLLM engine, and base vs adapter vs merged policies.

For each model (the shipped tiny dense policy, and a random-init model with Qwen3-0.6B's shapes
built locally by lorarl.assets.models with ``--layers`` layers; float32, nothing downloaded):

- a rollout service process (`lorarl serve rollout`, vLLM engine) and, in this process, a raw
  vLLM AsyncLLM started with the same engine arguments are both up; the same batch (``--groups``
  prompts x ``--n`` completions, fixed length via ignore_eos) goes to each in turn, ``--rounds``
  times, and the best tokens/s of each is compared (target: service >= 0.9 x raw). On a shared
  machine the best round is the least disturbed; alternating rounds exposes both to the same load.
- through the service: tokens/s of the base model, of a rank-16 all-linear adapter (mode 1,
  LoadWeights) and of the same adapter merged into the weights (mode 2; target >= 0.9 x the raw
  base engine, as merged weights cost nothing at generation time), each mode's rounds alternated
  with rounds of the raw base engine as the yardstick; plus how long each load took.

    .venv/bin/python bench/rollout_throughput.py                 # tiny + 0.6B-shaped with 4 layers
    .venv/bin/python bench/rollout_throughput.py --layers 2 --skip-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
HEADING = "## Rollout throughput"
SERVICE_TARGET = 0.9
MERGED_TARGET = 0.9
TOKEN = "bench-rollout-token"
RANK = 16
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelCase:
    name: str
    path: Path
    prompt_len: int
    max_tokens: int
    max_model_len: int
    rounds: int
    parameters: int = 0
    raw: dict[str, list[float]] = field(default_factory=dict)  # per mode: the raw base engine's rounds
    service: dict[str, list[float]] = field(default_factory=dict)  # per mode: the service's rounds
    load_s: dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ models


def tiny_model() -> Path:
    from lorarl.assets.paths import DENSE_MODEL_DIR

    if (DENSE_MODEL_DIR / "config.json").is_file():
        return DENSE_MODEL_DIR
    return build("qwen3-tiny", None)


def build(shape: str, layers: int | None) -> Path:
    """A random-init model of a named shape (lorarl.assets.models), cached under the temp dir."""
    from lorarl.assets.models import build_random_model

    out = Path(tempfile.gettempdir()) / "lorarl-bench" / f"{shape}-L{layers or 'all'}-fp32"
    if not (out / "config.json").is_file():
        print(f"building {shape} ({layers or 'all'} layers) in {out} ...", flush=True)
        build_random_model(shape, out, num_layers=layers, dtype=torch.float32)
    return out


def random_adapter(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    from lorarl.rollout.model_files import ModelFiles

    files = ModelFiles(path)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in files.weight_names():
        module = name.removesuffix(".weight")
        shape = files.shape(name)
        if module.rsplit(".", 1)[-1] in MODULES and shape is not None and len(shape) == 2:
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, shape[1], generator=g) * 0.02
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(shape[0], RANK, generator=g) * 0.02
    return tensors


# ------------------------------------------------------------------------------------ processes


def settings_for(case: ModelCase, max_num_seqs: int) -> dict[str, Any]:
    return {"model_path": str(case.path), "engine": "vllm", "dtype": "float32", "max_model_len": case.max_model_len,
            "kv_cache_gib": 1.0, "max_num_seqs": max_num_seqs, "max_loras": 2, "max_lora_rank": RANK,
            "max_queued_requests": 4096, "enable_lora": True}


def start_service(case: ModelCase, workdir: Path, max_num_seqs: int) -> tuple[subprocess.Popen[bytes], str]:
    from lorarl.common.ready import wait_for_ready_file

    config = {"server": {"port": 0, "metrics_port": -1, "log_level": "warning"},
              "rollout": settings_for(case, max_num_seqs)}
    config_path = workdir / f"{case.name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    ready = workdir / f"{case.name}.ready.json"
    log = (workdir / f"{case.name}.log").open("wb")
    env = {**os.environ, "LORARL_AUTH_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "lorarl.client.cli", "serve", "rollout",
                                "--config", str(config_path), "--ready-file", str(ready)],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    info = wait_for_ready_file(ready, timeout=600, process=process)
    return process, info["address"]


# ------------------------------------------------------------------------------------- workloads


def prompts(case: ModelCase, groups: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 256, (case.prompt_len,), generator=g).tolist() for _ in range(groups)]


async def raw_round(llm: Any, batch: list[list[int]], n: int, max_tokens: int, tag: str) -> float:
    """tokens/s of the batch on the raw AsyncLLM (final outputs only: the cheapest way to consume it)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)

    async def one(i: int, prompt: list[int]) -> int:
        final = None
        async for out in llm.generate({"prompt_token_ids": prompt}, params, f"raw-{tag}-{i}"):
            final = out
        assert final is not None
        return sum(len(c.token_ids) for c in final.outputs)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))
    return tokens / (time.perf_counter() - start)


async def service_round(stub: Any, batch: list[list[int]], n: int, max_tokens: int, job: str = "") -> float:
    """tokens/s of the batch through gRPC: one Generate per prompt (a GRPO group of n), all at once."""
    from lorarl.v1 import common_pb2, rollout_pb2

    sampling = common_pb2.SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    policy = rollout_pb2.PolicySelector(job_id=job)

    async def one(prompt: list[int]) -> int:
        response = await stub.Generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=prompt)], sampling=sampling, policy=policy), timeout=1800)
        return sum(len(c.token_ids) for c in response.results[0].completions)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in batch)))
    return tokens / (time.perf_counter() - start)


async def load(stub: Any, job: str, tensors: dict[str, torch.Tensor], mode: int, fingerprint: str) -> float:
    from lorarl.rollout.client import load_weights_stream
    from lorarl.v1 import common_pb2

    lora = common_pb2.LoraSpec(rank=RANK, alpha=2.0 * RANK) if mode == common_pb2.SYNC_MODE_ADAPTER else None
    start = time.perf_counter()
    await stub.LoadWeights(load_weights_stream(job, 1, tensors, mode, fingerprint, lora), timeout=1800)
    return time.perf_counter() - start


async def measure(case: ModelCase, args: argparse.Namespace, address: str) -> None:
    from lorarl.common.channel import aio_channel
    from lorarl.contract.lora import LoraSpec
    from lorarl.rollout.config import RolloutSettings
    from lorarl.rollout.model_files import ModelFiles
    from lorarl.rollout.payloads import complete_weights, merge_adapter
    from lorarl.rollout.vllm.engine import VllmEngine
    from lorarl.v1 import common_pb2, rollout_pb2_grpc

    batch = prompts(case, args.groups)
    raw_engine = VllmEngine(RolloutSettings(**settings_for(case, args.groups * args.n)))
    await raw_engine.start()
    try:
        async with aio_channel(address, token=TOKEN) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)

            async def alternate(mode: str, job: str) -> None:
                """Rounds alternating raw base engine and service (policy `job`): both see the same load."""
                raw, service = case.raw.setdefault(mode, []), case.service.setdefault(mode, [])
                for r in range(case.rounds):
                    raw.append(await raw_round(raw_engine.llm, batch, args.n, case.max_tokens, f"{mode}{r}"))
                    service.append(await service_round(stub, batch, args.n, case.max_tokens, job))
                    print(f"[{case.name}] {mode} round {r}: raw base {raw[-1]:,.0f} tok/s, service {mode} "
                          f"{service[-1]:,.0f} tok/s", flush=True)

            print(f"[{case.name}] warm-up", flush=True)
            await raw_round(raw_engine.llm, batch[:2], 2, 8, "warm")
            await service_round(stub, batch[:2], 2, 8)
            await alternate("base", "")
            files = ModelFiles(case.path)
            fingerprint = files.fingerprint()
            adapter = random_adapter(case.path)
            case.load_s["adapter"] = await load(stub, "lora", adapter, common_pb2.SYNC_MODE_ADAPTER, fingerprint)
            await service_round(stub, batch[:2], 2, 8, "lora")
            await alternate("adapter", "lora")
            lora = LoraSpec(rank=RANK, alpha=2.0 * RANK, target_modules=MODULES)
            merged = dict(complete_weights(merge_adapter(adapter, lora, files), files))
            case.load_s["merged"] = await load(stub, "merged", merged, common_pb2.SYNC_MODE_MERGED, fingerprint)
            del merged
            await alternate("merged", "merged")
    finally:
        await raw_engine.close()


def run_case(case: ModelCase, args: argparse.Namespace) -> None:
    from lorarl.rollout.model_files import ModelFiles

    files = ModelFiles(case.path)
    case.parameters = sum(_numel(files.shape(n)) for n in files.weight_names())
    with tempfile.TemporaryDirectory(prefix="lorarl-bench-rollout-") as tmp:
        process, address = start_service(case, Path(tmp), args.groups * args.n)
        try:
            asyncio.run(measure(case, args, address))
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def _numel(shape: tuple[int, ...] | None) -> int:
    out = 1
    for d in shape or ():
        out *= d
    return out


# -------------------------------------------------------------------------------------- reporting


def table(cases: list[ModelCase], args: argparse.Namespace) -> tuple[list[str], bool]:
    ok = True
    rows = []
    targets = {"base": SERVICE_TARGET, "merged": MERGED_TARGET}
    labels = {"base": "service (gRPC), base model", "adapter": f"service, adapter r{RANK} all-linear (mode 1)",
              "merged": "service, same adapter merged (mode 2)"}
    for c in cases:
        for mode in ("base", "adapter", "merged"):
            service, raw = max(c.service[mode]), max(c.raw[mode])
            ratio = service / raw
            target = targets.get(mode)
            result = "" if target is None else ("PASS" if ratio >= target else "FAIL")
            ok &= result != "FAIL"
            median = statistics.median(c.service[mode]) / statistics.median(c.raw[mode])
            rows.append(f"| {c.name} | {labels[mode]} | {service:,.0f} | {raw:,.0f} | {ratio:.2f} | {median:.2f} | "
                        f"{'' if target is None else f'>= {target}'} | {result} |")
    loads = [f"{c.name}: adapter {c.load_s['adapter']:.2f} s, merged {c.load_s['merged']:.2f} s" for c in cases]
    load_avg = os.getloadavg()[0]
    lines = [
        f"vLLM {_version('vllm')} CPU backend (fp32, enforce_eager, worker inside the engine-core process), "
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, load average {load_avg:.1f} at the "
        f"end of the run. Batch: {args.groups} prompts x n={args.n} completions, temperature 1, ignore_eos; "
        + "; ".join(f"{c.name}: {c.parameters:,} parameters, {c.prompt_len}-token prompts, {c.max_tokens} new tokens, "
                    f"{c.rounds} rounds per mode" for c in cases)
        + ". The service runs in its own process (`lorarl serve rollout`, one Generate per prompt, all at once); "
        "the baseline is a raw vLLM AsyncLLM in the benchmark process with the same engine arguments serving the "
        "base model, consuming final outputs only. Both are up at once and each mode's rounds alternate with "
        "baseline rounds, so both see the same machine load; ratio = best service round / best "
        "baseline round (on a shared machine the best round is the least disturbed), median = ratio of medians. "
        "Load time through LoadWeights (inline gRPC chunks, checksums verified, then engine load): "
        + "; ".join(loads) + ".",
        "",
        "| model | what | tokens/s | raw engine tokens/s | ratio | median ratio | target | result |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        *rows,
        "",
        f"Command: `.venv/bin/python bench/rollout_throughput.py{_suffix(args)}`",
    ]
    return lines, ok


def _version(package: str) -> str:
    import importlib

    return getattr(importlib.import_module(package), "__version__", "?")


def _suffix(args: argparse.Namespace) -> str:
    parts = []
    if args.layers != 4:
        parts.append(f"--layers {args.layers}")
    if args.skip_tiny:
        parts.append("--skip-tiny")
    if args.skip_06b:
        parts.append("--skip-06b")
    if (args.groups, args.n, args.rounds, args.tiny_rounds) != (8, 4, 3, 7):
        parts.append(f"--groups {args.groups} --n {args.n} --rounds {args.rounds} --tiny-rounds {args.tiny_rounds}")
    return (" " + " ".join(parts)) if parts else ""


def write_results(title: str, body: list[str]) -> None:
    """This run under its own sub-heading of this benchmark's section of bench/RESULTS.md."""
    from bench.results import write_results as write_section

    write_section(HEADING, title, body, RESULTS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-0.6B-shaped model (real: 28)")
    parser.add_argument("--groups", type=int, default=8, help="prompts per batch (one Generate each)")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt (GRPO group size)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode, Qwen3-0.6B-shaped model")
    parser.add_argument("--tiny-rounds", type=int, default=7, help="rounds per mode, tiny model (rounds are short)")
    parser.add_argument("--tiny-tokens", type=int, default=256)
    parser.add_argument("--06b-tokens", dest="tokens_06b", type=int, default=64)
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--skip-06b", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the engines use rollout.kv_cache_gib

    cases = []
    if not args.skip_tiny:
        cases.append(ModelCase("qwen3-tiny", tiny_model(), prompt_len=16, max_tokens=args.tiny_tokens,
                               max_model_len=512, rounds=args.tiny_rounds))
    if not args.skip_06b:
        cases.append(ModelCase(f"qwen3-0.6b-shaped ({args.layers} layers)", build("qwen3-0.6b", args.layers),
                               prompt_len=32, max_tokens=args.tokens_06b, max_model_len=512, rounds=args.rounds))
    started = time.perf_counter()
    for case in cases:
        run_case(case, args)
    body, ok = table(cases, args)
    print("\n".join(body))
    print(f"\n{'PASS' if ok else 'FAIL'} ({time.perf_counter() - started:.0f} s)")
    if not args.no_write:
        write_results(f"### cpu, float32, batch {args.groups} x {args.n}", body)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
