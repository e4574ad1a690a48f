"""`lorarl run A.yaml B.yaml ...`: several jobs on one local stack — one trainer holding the base once, one
rollout serving every job's adapters, one weight sync.

The jobs must agree on what the services are built from (the base model, its dtype, the engines, the device,
the rollout's shape); the rollout is sized for all of them (adapter slots for every job's staleness window,
the largest rank, every job's batch in one decode wave). Each job then runs as its own `lorarl train`
process against the stack, its output lines prefixed with its job id: the loops share nothing but the
services, so one job's failure or exit is its own, and each resumes from its own output dir like a single
`lorarl run`. The supervisor restarts a service that dies, as for one job; the jobs ride it through.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorarl.client.job.config import serving_length
from lorarl.client.job.plan import rollout_lora_blocker
from lorarl.client.launch.attach import wait_for_attached
from lorarl.client.launch.launcher_record import launcher_recorded
from lorarl.client.launch.local import lorarl_command
from lorarl.client.launch.services import (
    decode_wave,
    local_stack,
    metrics_line,
    stack_sections,
    version_teacher_refusal,
)
from lorarl.common.config import ConfigError, to_dict
from lorarl.common.parent_watch import child_env
from lorarl.contract import sharing, staleness
from lorarl.contract.lora import serving_rank

POLL_S = 0.5


def check_shareable(cfgs: Sequence[Any]) -> None:
    """ConfigError naming the first setting the jobs disagree on, or what a shared stack cannot run (the rule is
    lorarl.contract.sharing's, which attach, the Tinker front and the trainer apply too)."""
    for cfg in cfgs:
        if cfg.launcher.kind != "local" or cfg.placement.nodes > 1:
            raise ConfigError("launcher.kind", f"job {cfg.job_id}: several jobs share a stack on this host only "
                                               "(launcher.kind=local, placement.nodes=1)")
        if key := cfg.model_teacher_key():
            raise ConfigError(key, f"job {cfg.job_id}: a full-model teacher's engine is started for a job of its own "
                                   "only, not on a stack several jobs share (not built): make the teacher an adapter "
                                   "of the job's base, or run the job alone")
        if key := cfg.version_teacher_key():
            raise ConfigError(key, version_teacher_refusal(cfg))
    if problem := sharing.disagreement([(cfg.job_id, to_dict(cfg)) for cfg in cfgs]):
        raise ConfigError(*problem)
    for cfg in cfgs:  # a rollout without LoRA would merge each job's adapter over the base they all sample from
        try:
            cannot = rollout_lora_blocker(cfg)
        except ValueError:  # no model shape to read: the job's own plan says so
            continue
        if cannot:
            engine = sharing.EngineLora(False, 0, True, cfg.rollout.engine, cannot)
            raise ConfigError("rollout.enable_lora", f"job {cfg.job_id}: {sharing.sharing_refusal(engine, 0)}")
    for seen, name in ((set(), "job_id"), (set(), "output.dir")):
        for cfg in cfgs:
            value = cfg.job_id if name == "job_id" else str(Path(cfg.output.dir).resolve())
            if value in seen:
                raise ConfigError(name, f"two jobs have {name} {value!r}; each job needs its own")
            seen.add(value)


def shared_sections(cfgs: Sequence[Any], out: Path, min_rank: int = 0) -> dict[str, dict[str, Any]]:
    """The first job's service sections, with the rollout sized for every job (the one formula for a rollout that
    several jobs share): adapter slots for every job's staleness window, the largest rank (at least
    ``min_rank``: a Tinker front's clients pick theirs later), every job's batch in one decode wave; and marked
    shared, so that nothing is ever merged over the base they all sample from."""
    sections = stack_sections(cfgs[0], out)
    rollout = sections["rollout"]
    windows = [staleness.adapter_window(cfg.loop.max_staleness) for cfg in cfgs]
    rollout["adapter_window"] = max(windows)
    rollout["max_loras"] = max(sum(window + 1 for window in windows), *(cfg.rollout.max_loras for cfg in cfgs))
    rollout["max_lora_rank"] = max(serving_rank(min_rank) if min_rank else 0,
                                   *(cfg.serving_lora_rank for cfg in cfgs))
    rollout["kv_cache_gib"] = max(cfg.rollout.kv_cache_gib for cfg in cfgs)
    rollout["max_num_seqs"] = sum(decode_wave(cfg) for cfg in cfgs)
    rollout["shared"] = True
    if lengths := [length for cfg in cfgs if (length := serving_length(cfg))]:
        rollout["max_model_len"] = max(lengths)
    if any(cfg.rollout.openai for cfg in cfgs):
        rollout["openai_port"] = 0
    return sections


def _relay(stream: Any, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        print(f"{prefix}{line}", end="", flush=True)


def run_jobs(cfgs: Sequence[Any], config_paths: Sequence[str], overrides: Sequence[str], fresh: bool) -> int:
    """Starts the shared stack, runs every job against it, stops it; the worst exit code of the jobs."""
    check_shareable(cfgs)
    out = Path(cfgs[0].output.dir)
    out.mkdir(parents=True, exist_ok=True)
    stack = local_stack(cfgs[0], out, sections=shared_sections(cfgs, out))
    restarts = cfgs[0].recovery.restarts if cfgs[0].recovery.enabled else 0
    children: list[tuple[str, subprocess.Popen[str]]] = []
    try:  # the launcher of every job's directory: `lorarl stop` on any of them stops them all, with the stack
        with launcher_recorded(*(Path(cfg.output.dir) / "services" for cfg in cfgs)), stack:
            print(f"lorarl: services up for {len(cfgs)} jobs (trainer {stack.address('trainer')}, rollout "
                  f"{', '.join(stack.addresses('rollout'))}, weightsync {stack.address('weightsync')}); logs in "
                  f"{out / 'services'}", flush=True)
            if line := metrics_line(stack, out):  # the stack is the first job's: its output.prometheus
                print(line, flush=True)
            stack.supervise(restarts)
            for cfg, path in zip(cfgs, config_paths, strict=True):
                # adapters only (auto could pick merged, whose version replaces the base the other jobs share)
                command = [*lorarl_command(), "train", path, *overrides, "sync.mode=adapter",
                           "--trainer", stack.address("trainer"),
                           "--weightsync", stack.address("weightsync"), "--token-file", str(stack.token_file),
                           *(["--openai", ",".join(stack.openai_urls())] if cfg.rollout.openai else []),
                           *(["--fresh"] if fresh else [])]
                child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         bufsize=1, env={**os.environ, **child_env()})  # gone with this launcher
                threading.Thread(target=_relay, args=(child.stdout, f"[{cfg.job_id}] "), daemon=True).start()
                children.append((cfg.job_id, child))
            while any(child.poll() is None for _, child in children):
                if stack.failure is not None:
                    print(f"lorarl: stopping the jobs: {stack.failure}", file=sys.stderr, flush=True)
                    _stop(children)
                    return 1
                time.sleep(POLL_S)
            wait_for_attached(stack.workdir, stack.raise_if_failed)
    except KeyboardInterrupt:
        _stop(children)
        print("lorarl: interrupted; jobs and services stopped. Run the same command again to resume.",
              file=sys.stderr)
        return 130
    codes = {job: child.returncode for job, child in children}
    print("lorarl: " + ", ".join(f"{job} exited {code}" for job, code in codes.items()), flush=True)
    return max(codes.values(), default=0)


def _stop(children: Sequence[tuple[str, subprocess.Popen[str]]]) -> None:
    """SIGTERM each job (it stops resumable, as on Ctrl-C), then SIGKILL what outlives the bound."""
    for _, child in children:
        if child.poll() is None:
            child.terminate()
    for _, child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
