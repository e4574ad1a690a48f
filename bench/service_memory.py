"""The memory plan against the real service processes (#29 item 3): `lorarl run`'s own stack, at real shapes.

Per setting, a random-init model with real layer shapes (Qwen3-0.6B or Qwen3-1.7B, 2-4 layers, the full
151,936-token vocabulary, fp32; lorarl.assets.models.build_random_model) runs the demo job through
bench/lorarl_job.py (the three services started as `lorarl run` starts them, vLLM on CPU, rank-32 LoRA),
two steps, sync or async, with completions of 512-4,096 tokens (a random policy rarely samples EOS, so they run
to max_tokens). Every service process and its children are sampled every 0.25 s (resident set over time) and
each one's peak (VmHWM, so no peak falls between samples) is set beside what `lorarl run --dry-run` plans for
it (lorarl.client.job.plan.service_plans). A row passes within ±20%. The first setting runs a second time with
glibc's own sliding mmap threshold instead of the trainer service's fixed 8 MiB, for the trainer's peak and step
seconds side by side.

    .venv/bin/python bench/service_memory.py            # five settings + the allocator pair, ~30 min on 2 cores
    .venv/bin/python bench/service_memory.py --settings 0.6b:2:512:4x4:sync --no-write
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The whole system: it runs `lorarl run`'s stack (bench/results.py's stale check).
MEASURES = ("lorarl",)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADING = "## Service processes: memory plan vs measured"
GIB = 1 << 30
TOLERANCE = 0.20
#: shape:layers:completion:prompts x group:mode
FULL = ["0.6b:2:512:4x4:sync", "0.6b:4:4096:1x2:sync", "0.6b:2:512:4x4:async", "1.7b:2:512:2x4:sync",
        "1.7b:2:2048:1x2:async"]
#: Settings run as two jobs on one stack (#31: one base resident, shown against the plan).
SHARED = "0.6b:2:512:4x4:async"


@dataclass(frozen=True)
class Setting:
    shape: str
    layers: int
    completion: int
    prompts: int
    group: int
    mode: str

    @classmethod
    def parse(cls, text: str) -> Setting:
        shape, layers, completion, batch, mode = text.split(":")
        prompts, group = (int(v) for v in batch.split("x"))
        return cls(f"qwen3-{shape}", int(layers), int(completion), prompts, group, mode)

    def __str__(self) -> str:
        return (f"{self.shape} x {self.layers}, {self.completion} tokens, {self.prompts} x {self.group}, "
                f"{self.mode}")


class Sampler:
    """Resident set of every service process and its children, every ``period_s``, until stopped."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s, self.stack = period_s, None
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.peaks: dict[str, float] = {}  # each process's VmHWM as last read (GiB): its peak up to then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        from bench.scaling import peak_rss_gib

        started = time.monotonic()
        while not self._stop.wait(self.period_s):
            if self.stack is None:
                continue
            for name, svc in list(self.stack.processes.items()):
                try:
                    for key, pid in named_processes(name, svc.process.pid):
                        self.samples.setdefault(key, []).append(
                            (time.monotonic() - started, psutil.Process(pid).memory_info().rss / GIB))
                        self.peaks[key] = max(self.peaks.get(key, 0.0), peak_rss_gib(pid))
                except (psutil.Error, OSError):
                    pass


def named_processes(service: str, pid: int) -> list[tuple[str, int]]:
    """(the plan's name, pid) for a service's process and its vLLM engine core; other children (a compiler
    vLLM runs once, multiprocessing's resource tracker) are not planned."""
    import psutil

    parent = psutil.Process(pid)
    own = f"{service}-0" if service == "rollout" else service
    found = [(own, pid)]
    for child in parent.children(recursive=True):
        if child.name().startswith("VLLM::EngineCor"):
            found.append((f"{own} engine core", child.pid))
    return found


@dataclass
class Measured:
    rows: list[tuple[str, float, float, float]]  # (process, planned GiB, measured peak GiB, last sampled GiB)
    train_s: float  # the trainer's seconds in its steps, summed


def run_setting(setting: Setting, tmp: Path, trainer_settings: dict | None = None, tag: str = "") -> Measured:
    """One run of ``setting``; ``trainer_settings`` override the trainer service's section (the allocator)."""
    import torch

    import lorarl.client.launch.services as services
    from bench.lorarl_job import run_job
    from bench.scaling import peak_rss_gib
    from lorarl.assets.models import build_random_model
    from lorarl.client.job.config import load_job_config
    from lorarl.client.job.plan import service_plans

    model = tmp / f"{setting.shape}-{setting.layers}"
    if not model.exists():
        build_random_model(setting.shape, model, num_layers=setting.layers, dtype=torch.float32)
    out = tmp / f"run-{setting.shape}-{setting.layers}-{setting.completion}-{setting.mode}{tag}"
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"), [
        f"model.path={model}", f"loop.mode={setting.mode}", "loop.steps=2",
        f"loop.prompts_per_step={setting.prompts}", "loop.eval_every=0", "data.eval_size=1",
        f"rollout.group_size={setting.group}", f"rollout.max_tokens={setting.completion}",
        "rollout.eval_max_tokens=1", "rollout.kv_cache_gib=2", "trainer.lora.rank=32", "trainer.lora.alpha=64",
        "rollout.max_lora_rank=32", f"output.dir={out}", "output.tensorboard=false", "output.progress=false"])
    planned = {p.name: p.total / GIB for p in service_plans(cfg) or []}
    sampler = Sampler()
    made, sections = services.local_stack, services.stack_sections

    def watched(*args, **kwargs):
        sampler.stack = made(*args, **kwargs)
        return sampler.stack

    def with_trainer_settings(*args, **kwargs):
        found = sections(*args, **kwargs)
        found["trainer"].update(trainer_settings or {})
        return found

    peaks: dict[str, float] = {}

    def read_peaks(stack) -> None:
        for name, svc in stack.processes.items():
            for key, pid in named_processes(name, svc.process.pid):
                peaks[key] = max(peaks.get(key, 0.0), peak_rss_gib(pid))

    services.local_stack, services.stack_sections = watched, with_trainer_settings
    sampler.start()
    try:
        timing = run_job(cfg, out, before_stop=read_peaks)
    finally:
        sampler.stop()
        services.local_stack, services.stack_sections = made, sections
    rows = []
    for name, plan in planned.items():
        series = sampler.samples.get(name, [(0.0, float("nan"))])
        rows.append((name, plan, peaks.get(name, float("nan")), series[-1][1]))
    return Measured(rows, sum(r.get("train/time_s", 0.0) for r in timing.steps))


def job_file(path: Path, values: dict[str, object]) -> Path:
    """examples/demo.yaml with ``values`` (dotted keys) set, written to ``path``: a job file of its own."""
    import yaml

    data = yaml.safe_load((ROOT / "examples/demo.yaml").read_text())
    for dotted, value in values.items():
        *parents, key = dotted.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_shared(setting: Setting, tmp: Path, ranks: tuple[int, ...] = (32, 16)) -> Measured:
    """Jobs of ``setting`` (one per rank in ``ranks``, the demo task each) on one stack as `lorarl run A.yaml
    B.yaml` starts it (lorarl.client.launch.many_jobs.run_jobs): each service process's peak beside
    lorarl.client.job.plan.shared_service_plans. The jobs' own `lorarl train` processes are clients, not planned."""
    import torch

    import lorarl.client.launch.many_jobs as many_jobs
    from lorarl.assets.models import build_random_model
    from lorarl.client.job.config import load_job_config
    from lorarl.client.job.plan import shared_service_plans

    model = tmp / f"{setting.shape}-{setting.layers}"
    if not model.exists():
        build_random_model(setting.shape, model, num_layers=setting.layers, dtype=torch.float32)
    out = tmp / f"shared-{setting.shape}-{setting.layers}-{setting.completion}-{setting.mode}"
    files = [str(job_file(tmp / f"job-r{rank}.yaml", {
        "job_id": f"r{rank}", "model.path": str(model), "loop.mode": setting.mode, "loop.steps": 2,
        "loop.prompts_per_step": setting.prompts, "loop.eval_every": 0, "loop.checkpoint_every": 0,
        "data.eval_size": 1, "rollout.group_size": setting.group, "rollout.max_tokens": setting.completion,
        "rollout.eval_max_tokens": 1, "rollout.kv_cache_gib": 2, "trainer.lora": {
            "rank": rank, "alpha": 2 * rank, "target_modules": ["all-linear"]},
        "rollout.max_lora_rank": max(ranks), "output.dir": str(out / f"r{rank}"), "output.tensorboard": False,
        "output.progress": False})) for rank in ranks]
    cfgs = [load_job_config(f, []) for f in files]
    rollout = many_jobs.shared_sections(cfgs, Path(cfgs[0].output.dir))["rollout"]
    planned = {p.name: p.total / GIB for p in shared_service_plans(cfgs, rollout) or []}
    sampler = Sampler()
    made = many_jobs.local_stack

    def watched(*args, **kwargs):
        sampler.stack = made(*args, **kwargs)
        return sampler.stack

    many_jobs.local_stack = watched
    sampler.start()
    try:
        code = many_jobs.run_jobs(cfgs, files, [], fresh=True)
    finally:
        sampler.stop()
        many_jobs.local_stack = made
    if code:
        raise RuntimeError(f"`lorarl run` of {len(files)} jobs exited {code}")
    rows = [(name, plan, sampler.peaks.get(name, float("nan")), sampler.samples.get(name, [(0, float("nan"))])[-1][1])
            for name, plan in planned.items()]
    return Measured(rows, 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=",".join(FULL), help="comma-separated shape:layers:completion:"
                        "prompts x group:mode, e.g. 0.6b:2:512:4x4:sync")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    parser.add_argument("--no-allocator", dest="allocator", action="store_false",
                        help="skip the first setting's second run with glibc's own mmap threshold")
    parser.add_argument("--shared", default=SHARED, help="comma-separated settings run as two jobs (rank 32 and "
                        "16) on one stack, `lorarl run A.yaml B.yaml` ('' for none)")
    args = parser.parse_args()
    settings = [Setting.parse(s) for s in args.settings.split(",")]
    shared_settings = [Setting.parse(s) for s in args.shared.split(",") if s]
    lines = ["| setting | process | plan GiB | measured peak GiB | plan/measured | within ±20% |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    worst, failed = 0.0, 0
    allocator = ["| trainer allocator | trainer peak GiB | train s (2 steps) |", "| --- | ---: | ---: |"]
    with tempfile.TemporaryDirectory(prefix="lorarl-service-memory-") as tmp:
        for index, setting in enumerate(settings):
            measured = run_setting(setting, Path(tmp))
            if index == 0 and args.allocator:  # the service's default beside glibc's own, one run each
                glibc = run_setting(setting, Path(tmp), {"malloc_mmap_threshold_mib": 0}, "-glibc")
                for label, m in (("8 MiB mmap threshold (the default)", measured),
                                 ("glibc's sliding threshold", glibc)):
                    peak = next(p for n, _, p, _ in m.rows if n == "trainer")
                    allocator.append(f"| {label} | {peak:.2f} | {m.train_s:.1f} |")
                    print(allocator[-1], flush=True)
            runs = [(str(setting), measured)]
            if index == len(settings) - 1:  # then the settings run as two jobs on one stack
                runs += [(f"{shared}, 2 jobs (rank 32 + 16) on one stack", run_shared(shared, Path(tmp)))
                         for shared in shared_settings]
            for label, result in runs:
                for name, plan, peak, _ in result.rows:
                    ratio = plan / peak if peak == peak and peak else float("nan")
                    ok = abs(ratio - 1) <= TOLERANCE
                    failed += not ok
                    worst = max(worst, abs(ratio - 1)) if ratio == ratio else worst
                    line = f"| {label} | {name} | {plan:.2f} | {peak:.2f} | {ratio:.2f} | {'yes' if ok else 'NO'} |"
                    print(line, flush=True)
                    lines.append(line)
    verdict = (f"every row within ±{TOLERANCE:.0%}: {'PASS' if not failed else 'FAIL'} "
               f"(worst {worst:+.0%} off{f'; {failed} row(s) outside' if failed else ''})")
    print(verdict)
    if not args.no_write:
        from bench.results import write_results

        title = (f"### {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, fp32, rank 32, "
                 f"{len(settings)} settings" + (f" + {len(shared_settings)} on one stack" if shared_settings else ""))
        pair = (["The first setting again with glibc's sliding mmap threshold (trainer.malloc_mmap_threshold_mib=0), "
                 "side by side:", "", *allocator, ""] if args.allocator else [])
        notes = ["", verdict, "", *pair,
                 "Per row: `lorarl run`'s stack (bench/lorarl_job.py) runs two steps of the demo job on a random-init",
                 "model with the named shape; 'measured peak' is the process's VmHWM read before the services stop;",
                 "'plan' is what `lorarl run --dry-run` prints for that process (lorarl/client/job/process_memory.py);",
                 "a '2 jobs on one stack' row runs `lorarl run A.yaml B.yaml` (2 steps each) against the shared",
                 "stack's plan (lorarl.client.job.plan.shared_service_plans: the base once in the trainer).",
                 "The trainer service fixes glibc's mmap threshold at 8 MiB (trainer.malloc_mmap_threshold_mib)."]
        write_results(HEADING, title, [*lines, *notes])
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
