"""One base (#44 step 6): the co-located stack against the separate one, side by side, at real shapes.

Per setting, a random-init model with real layer shapes (Qwen3-0.6B or Qwen3-1.7B, 2 or 4 layers, the full
151,936-token vocabulary, fp32; lorarl.assets.models.build_random_model) runs the demo job through
bench/lorarl_job.py (the services started as `lorarl run` starts them, vLLM on CPU, rank-32 LoRA, the sync
loop) twice, one after the other, with the same engine and loop settings:

- **separate**: the trainer and the vLLM engine each load their own copy of the base; adapter versions move over
  a gloo group;
- **co-located** (``placement.colocate=true``): ONE copy in a memory file the launcher holds, mapped by both;
  adapter versions reach the engine as memory files.

Measured, every 0.25 s over every process of the stack (the services, vLLM's engine core, and this process, the
launcher): the sum of their proportional set sizes (PSS: a page mapped by two processes counts half in each, so
the shared copy counts once) and its peak; generation tokens/s (``rollout/tokens_per_s``), the trainer's step
seconds and the adapter handoff seconds (``sync/seconds``), each the mean over the steps after the first (warm-up);
and, co-located, the engine's own check that every parameter it serves lies in the shared segment (its log line;
the engine does not start otherwise: lorarl.rollout.vllm.shared_loader.check_served_from) and the segment's
resident bytes in the engine core's mapping (/proc/PID/smaps). A setting passes when the co-located peak is at
least 0.8 of one base copy below the separate one and every served parameter lies in the segment.

    .venv/bin/python bench/colocate.py                 # 1.7B x 2 and x 4 layers, ~15 min on 2 cores
    .venv/bin/python bench/colocate.py --quick --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The whole system: it runs `lorarl run`'s stack (bench/results.py's stale check).
MEASURES = ("lorarl",)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## One base: co-located vs separate stack"
GIB = 1 << 30
#: The co-located peak must sit at least this share of one base copy below the separate one (#44).
SAVING_GOAL = 0.8
SERVED_LINE = re.compile(r"shared base: all (\d+) parameters of the served model lie in the shared segment")


@dataclass
class StackMemory:
    """PSS of every process of a running stack, sampled until stopped: the peak of the sum, and each process's PSS
    at that moment (named as the plan names them)."""

    period_s: float = 0.25
    stack: object = None
    peak_gib: float = 0.0
    process_peaks: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        import psutil

        from bench.service_memory import named_processes

        while not self._stop.wait(self.period_s):
            if self.stack is None:
                continue
            found = [("launcher", os.getpid())]
            for name, svc in list(self.stack.processes.items()):
                with contextlib.suppress(psutil.Error, OSError):
                    found += named_processes(name, svc.process.pid)
            now = {}
            for key, pid in found:
                try:
                    now[key] = psutil.Process(pid).memory_full_info().pss / GIB
                except (psutil.Error, OSError):
                    continue
            if sum(now.values()) > self.peak_gib:
                self.peak_gib, self.process_peaks = sum(now.values()), now

    def stop(self, thread: threading.Thread) -> None:
        self._stop.set()
        thread.join()


@dataclass
class Run:
    peak_gib: float
    process_peaks: dict[str, float]
    tokens_per_s: float
    train_s: float
    handoff_s: float
    served_in_segment: int | None = None  # parameters the engine reported in the segment (co-located)
    segment_resident_gib: float | None = None  # the segment's resident bytes in the engine core's mapping


def segment_resident_gib(pid: int) -> float:
    """Resident bytes of the shared base's memory-file mapping(s) in process ``pid``."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = "memfd:lorarl-shared-base" in line
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total / GIB


def run_once(model: Path, out: Path, steps: int, completion: int, prompts: int, group: int,
             colocate: bool) -> Run:
    import lorarl.client.launch.services as services
    from bench.lorarl_job import run_job
    from bench.service_memory import named_processes
    from lorarl.client.job.config import load_job_config

    cfg = load_job_config(str(ROOT / "examples/demo.yaml"), [
        f"model.path={model}", "loop.mode=sync", f"loop.steps={steps}", f"loop.prompts_per_step={prompts}",
        "loop.eval_every=0", "loop.checkpoint_every=0", "data.eval_size=1", f"rollout.group_size={group}",
        f"rollout.max_tokens={completion}", "rollout.eval_max_tokens=1", "rollout.kv_cache_gib=1",
        "trainer.lora.rank=32", "trainer.lora.alpha=64", "rollout.max_lora_rank=32", f"output.dir={out}",
        "output.tensorboard=false", "output.progress=false", f"placement.colocate={str(colocate).lower()}"])
    memory = StackMemory()
    made = services.local_stack
    resident: list[float] = []

    def watched(*args, **kwargs):
        memory.stack = made(*args, **kwargs)
        return memory.stack

    def before_stop(stack) -> None:
        if colocate:
            cores = [pid for key, pid in named_processes("rollout", stack.processes["rollout"].process.pid)
                     if key.endswith("engine core")] or [stack.processes["rollout"].process.pid]
            resident.append(segment_resident_gib(cores[0]))

    services.local_stack = watched
    thread = memory.start()
    try:
        timing = run_job(cfg, out, before_stop=before_stop)
    finally:
        memory.stop(thread)
        services.local_stack = made
    steady = timing.steps[1:] or timing.steps

    def mean(key: str) -> float:
        values = [row[key] for row in steady if key in row]
        return sum(values) / len(values) if values else float("nan")

    served = None
    if colocate:
        logs = "".join(p.read_text(errors="replace") for p in (out / "services").glob("rollout*.log"))
        match = SERVED_LINE.search(logs)
        served = int(match.group(1)) if match else 0
    return Run(memory.peak_gib, dict(memory.process_peaks), mean("rollout/tokens_per_s"), mean("train/time_s"),
               mean("sync/seconds"), served, resident[0] if resident else None)


def gemm_rows(model: Path, rows: int = 8, repeats: int = 20) -> list[str]:
    """What generation pays for leaving shared weights unpacked: per projection shape of ``model``, one thread,
    ``rows`` rows (a decode batch), vLLM CPU's own packed oneDNN GEMM (what a private copy computes with) against
    lorarl.rollout.vllm.shared_loader.shared_linear on the row-major weight, side by side."""
    import json

    import torch
    from vllm import _custom_ops as ops

    from lorarl.rollout.vllm.shared_loader import shared_linear

    config = json.loads((model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {"qkv_proj": ((heads + 2 * kv) * dim, hidden), "o_proj": (hidden, heads * dim),
              "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter), "lm_head": (config["vocab_size"],
                                                                                             hidden)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the rollout's engine runs here
    lines = [f"| projection (out x in) | packed oneDNN ms ({rows} rows) | shared, unpacked ms | unpacked / packed |",
             "| --- | ---: | ---: | ---: |"]
    try:
        for name, (out, inp) in shapes.items():
            weight, x = torch.randn(out, inp), torch.randn(rows, inp)
            handler = ops.create_onednn_mm(weight.t(), 32)
            times = {}
            for label, run in (("packed", lambda h=handler, a=x: ops.onednn_mm(h, a, None)),
                               ("shared", lambda a=x, w=weight: shared_linear(a, w, None))):
                run()
                n = max(2, repeats // 10) if out * inp > 1e8 else repeats
                started = time.perf_counter()
                for _ in range(n):
                    run()
                times[label] = (time.perf_counter() - started) / n * 1000
            lines.append(f"| {name} ({out} x {inp}) | {times['packed']:.2f} | {times['shared']:.2f} | "
                         f"{times['shared'] / times['packed']:.2f}x |")
            print(lines[-1], flush=True)
    finally:
        torch.set_num_threads(threads)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="1.7b:2,1.7b:4", help="comma-separated shape:layers, e.g. 0.6b:2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--completion", type=int, default=128, help="rollout.max_tokens")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="0.6b:2, 2 steps of 32 tokens (a smoke run, ~2 min)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if args.quick:
        args.settings, args.steps, args.completion = "0.6b:2", 2, 32

    import torch

    from lorarl.assets.models import build_random_model
    from lorarl.contract.base_segment import checkpoint_index

    lines = ["| setting | stack | peak PSS GiB | trainer | engine core | rollout | weightsync | launcher | "
             "gen tokens/s | train step s | handoff s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    summary = ["| setting | base copy GiB | PSS saved GiB | saved / base | served params in segment | "
               "segment resident in engine GiB | gen tokens/s co-located / separate | handoff co-located / "
               "separate | pass |", "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="lorarl-colocate-") as tmp:
        for text in args.settings.split(","):
            shape, layers = text.split(":")
            model = Path(tmp) / f"qwen3-{shape}-{layers}"
            build_random_model(f"qwen3-{shape}", model, num_layers=int(layers), dtype=torch.float32)
            base_gib = sum(end - begin for _, begin, end, *_ in checkpoint_index(model).values()) / GIB
            setting = f"Qwen3-{shape.upper()} x {layers} layers"
            runs = {}
            for colocate in (False, True):  # one after the other, never at once
                name = "co-located" if colocate else "separate"
                runs[name] = run = run_once(model, Path(tmp) / f"run-{shape}-{layers}-{name}", args.steps,
                                            args.completion, args.prompts, args.group, colocate)
                procs = run.process_peaks
                lines.append(f"| {setting} | {name} | {run.peak_gib:.2f} | {procs.get('trainer', 0):.2f} | "
                             f"{procs.get('rollout-0 engine core', 0):.2f} | {procs.get('rollout-0', 0):.2f} | "
                             f"{procs.get('weightsync', 0):.2f} | {procs.get('launcher', 0):.2f} | "
                             f"{run.tokens_per_s:.1f} | {run.train_s:.2f} | {run.handoff_s:.3f} |")
                print(lines[-1], flush=True)
            apart, shared = runs["separate"], runs["co-located"]
            saved = apart.peak_gib - shared.peak_gib
            ok = saved >= SAVING_GOAL * base_gib and bool(shared.served_in_segment)
            failed += not ok
            summary.append(f"| {setting} | {base_gib:.2f} | {saved:.2f} | {saved / base_gib:.2f} | "
                           f"{shared.served_in_segment or 'NONE'} (all) | {shared.segment_resident_gib or 0:.2f} | "
                           f"{shared.tokens_per_s / apart.tokens_per_s:.2f}x | "
                           f"{shared.handoff_s / apart.handoff_s:.2f}x | {'yes' if ok else 'NO'} |")
            print(summary[-1], flush=True)
        gemm = gemm_rows(model)  # after the stacks: vLLM's kernels imported here would count in the launcher's PSS
    verdict = (f"co-located peak PSS at least {SAVING_GOAL} of one base copy below separate, every served parameter "
               f"in the shared segment: {'PASS' if not failed else 'FAIL'}")
    print(verdict)
    if not args.no_write:
        from bench.results import write_results

        title = (f"### {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, fp32, rank 32, "
                 f"{args.settings}, {args.steps} sync steps of {args.prompts} x {args.group} x {args.completion} "
                 "tokens")
        notes = ["", *summary, "", verdict, "",
                 "What generation pays for the one copy, per GEMM of the last setting's shape (one thread, 8 rows,",
                 "vLLM CPU's packed oneDNN kernel on a private copy against the shared, unpacked weight):", "",
                 *gemm, "",
                 "Per setting, `lorarl run`'s stack (bench/lorarl_job.py) runs the demo job on a random-init model of",
                 "the named shape twice, one after the other: separate (each service its own base, adapters over gloo)",
                 "and `placement.colocate=true` (one base in a memory file the launcher holds; adapters as memory",
                 "files). 'peak PSS' is the peak of the sum of every stack process's proportional set size (the",
                 "launcher is this benchmark's process), each process column its PSS at that peak; tokens/s, step and",
                 "handoff seconds are means over the steps after the first. 'served params in segment' is the",
                 "engine's own count at start (it refuses to start if any parameter left the segment)."]
        write_results(HEADING, title, [*lines, *notes])
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
