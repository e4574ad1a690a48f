"""End to end: a job finishes through SIGKILLs of its services (real processes, vLLM, gloo, gRPC).

- `lorarl run` (async, as the demo runs: a kill lands while batches generate and the trainer trains): the
  trainer, the rollout, the rollout's vLLM engine core and weight sync are killed in turn, mid-run; its
  supervisor restarts each and the loop carries on from its last resume point. The run is co-located
  (placement.colocate): each restarted service maps the launcher's one copy of the base again.
  With output.prometheus on, each service's /metrics is scraped once during the run, at the port its ready file
  names; a restarted service serves them on the same port.
- `lorarl train` against services it does not own: each is killed and started again by hand (same
  port, 3 s later, as compose or Kubernetes would); the loop waits each restart out. A re-run
  attaches to the job instead of failing with ALREADY_EXISTS.
bench/recovery.py measures the same faults (time to detect and recover) for bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from bench.recovery import TARGETS, Kill, lorarl_command, read_rows, run_with_faults
from lorarl.client.job.config import load_job_config
from lorarl.client.launch.services import local_stack

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
QUICK = ["loop.mode=sync", "loop.eval_every=0", "data.eval_size=50", "output.tensorboard=false",
         "output.progress=false"]
ASYNC = ["loop.mode=async", *QUICK[1:]]


def step_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "rollout/reward_mean" in r]


def assert_versions_never_reused(rows: list[dict], steps: int) -> None:
    done = step_rows(rows)
    assert [int(r["step"]) for r in done] == list(range(1, steps + 1))  # every step, each once
    versions = [int(r["sync/version"]) for r in done]
    assert versions == sorted(set(versions)), versions  # strictly upward: a number names one set of weights


def redone_steps(stderr: str) -> list[int]:
    """Per recovery: steps done before the fault that the loop did again (fault at N, carried on from S)."""
    redone, fault = [], None
    for line in stderr.splitlines():
        if (m := re.match(r"step (\d+): .*recovering \(fault", line)) and fault is None:
            fault = int(m.group(1))  # the first of a recovery's faults (a restore may meet more)
        elif (m := re.match(r"recovered: carrying on from step (\d+)", line)) and fault is not None:
            redone.append(fault - int(m.group(1)))
            fault = None
    assert redone, stderr[-3000:]
    return redone


def leftover_processes(marker: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and any(marker in part for part in p.info["cmdline"] or []):
                found.append(" ".join(p.info["cmdline"]))
        except psutil.Error:
            pass
    return found


#: A series each service's /metrics shows once the run has called it (lorarl.common.metrics; the trainer's per-job
#: series: lorarl.trainer.service.job_metrics).
SERIES = {"weightsync": "lorarl_rpc_handled_total{", "rollout": "lorarl_rpc_handled_total{",
          "trainer": 'lorarl_trainer_job_version{job_id="demo"}'}


def scrape_each_service(out: Path, scraped: dict[str, tuple[int, str]], stop: threading.Event) -> None:
    """Each service's /metrics, once it shows its series, at the port its ready file names; a service not up (or
    restarting) is tried again on the next round."""
    while set(SERIES) - set(scraped) and not stop.wait(0.5):
        for name in set(SERIES) - set(scraped):
            try:
                port = json.loads((out / "services" / f"{name}.ready.json").read_text())["metrics_port"]
                with urllib.request.urlopen(f"http://127.0.0.1:{int(port)}/metrics", timeout=5) as response:
                    body = response.read().decode()
            except (OSError, ValueError, KeyError, TypeError):  # no ready file yet, half a restart, ...
                continue
            if SERIES[name] in body:
                scraped[name] = (int(port), body)


def test_lorarl_run_finishes_through_a_sigkill_of_each_service(tmp_path: Path) -> None:
    out = tmp_path / "run"
    steps = 14
    kills = [Kill(target, 2 + 3 * i) for i, target in enumerate(TARGETS)]
    scraped: dict[str, tuple[int, str]] = {}
    stop = threading.Event()
    scraper = threading.Thread(target=scrape_each_service, args=(out, scraped, stop), daemon=True)
    scraper.start()
    try:
        run = run_with_faults(out, kills, [f"loop.steps={steps}", *ASYNC, "placement.colocate=true",
                                           "output.prometheus=true"], timeout_s=800)
    finally:
        stop.set()
        scraper.join(timeout=30)
    assert run.returncode == 0, run.text()
    # output.prometheus: every service served its metrics where its ready file (and the start line) said, and a
    # restarted one on the same port (its config file, rewritten at the restart, asks for the port it had)
    assert set(scraped) == set(SERIES), (sorted(scraped), run.text())
    assert "lorarl: Prometheus metrics at weightsync http://127.0.0.1:" in run.stdout, run.stdout[-2000:]
    for name, (port, _) in scraped.items():
        assert yaml.safe_load((out / "services" / f"{name}.yaml").read_text())["server"]["metrics_port"] == port
        assert f"{name} http://127.0.0.1:{port}/metrics" in run.stdout
    assert all(k.killed_at for k in kills), kills
    assert_versions_never_reused(run.rows, steps)
    stderr = "\n".join(line for _, line in run.stderr)
    for target in ("trainer", "rollout", "weightsync"):
        assert f"the {target} service is back" in stderr, stderr[-3000:]
    assert "exited with code 1" in stderr  # the rollout, after its engine core died, exited by itself
    assert all(n <= 1 for n in redone_steps(stderr)), stderr[-3000:]  # at most the step in flight
    assert not leftover_processes(str(out)), "a service or its engine core outlived the run"
    # co-located (#44): the restarted trainer and rollout mapped the launcher's shared base again; versions reached
    # the engine as memory files, never over a collective group (a restarted rollout catches up from the durable
    # copy, inline, as any replica does)
    services = out / "services"
    trainer_log = (services / "trainer.log").read_text()
    assert trainer_log.count("parameters are views of the shared base") >= 2, trainer_log[-2000:]
    rounds = [line for line in (services / "weightsync.log").read_text().splitlines() if " started: rollout" in line]
    assert not [line for line in rounds if "(collective)" in line], rounds
    assert sum("(shared_memory)" in line for line in rounds) >= steps // 2, rounds


def relaunch(stack, name: str, svc, port: int):
    """The service again on its own port, as compose or Kubernetes would start it. The port was an ephemeral
    number: in the seconds it was free, a connection elsewhere on the machine may have taken it as its local
    port, so a bind that fails as in use is tried again a few times before the test fails."""
    for attempt in range(5):
        try:
            return stack._launch(name, svc.section, svc.service, port=port)
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == 4:
                raise
            time.sleep(2)
    raise AssertionError("unreachable")


def test_lorarl_train_rides_through_restarts_of_services_it_does_not_own(tmp_path: Path) -> None:
    out = tmp_path / "train"
    steps = 12
    overrides = [f"loop.steps={steps}", f"output.dir={out}", *QUICK]
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"), overrides)
    stack = local_stack(cfg, out)  # started as a user would: `lorarl serve` per service, on loopback
    with stack:
        args = [*lorarl_command(), "train", "examples/demo.yaml", *overrides, "--trainer", stack.address("trainer"),
                "--rollout", stack.address("rollout"), "--weightsync", stack.address("weightsync"),
                "--token-file", str(stack.token_file)]
        env = {**stack.env(), "PYTHONUNBUFFERED": "1"}
        loop = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for at_step, name in ((2, "trainer"), (5, "rollout"), (8, "weightsync")):
                deadline = time.monotonic() + 400
                while len(step_rows(read_rows(out))) < at_step and loop.poll() is None:
                    assert time.monotonic() < deadline, f"no step {at_step}"
                    time.sleep(0.2)
                svc = stack.processes[name]
                os.killpg(svc.process.pid, signal.SIGKILL)  # the service and its engine core
                svc.process.wait(timeout=30)
                time.sleep(3)
                port = int(svc.address.rsplit(":", 1)[1])
                stack.processes[name] = relaunch(stack, name, svc, port)
            output, _ = loop.communicate(timeout=600)
        finally:
            if loop.poll() is None:
                loop.kill()
        assert loop.returncode == 0, output[-5000:]
        assert output.count("recovered: carrying on") >= 3, output[-5000:]
        assert_versions_never_reused(read_rows(out), steps)
        # Running the same command again attaches to the finished job instead of ALREADY_EXISTS.
        again = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "resumed from" in again.stdout and "ALREADY_EXISTS" not in again.stderr
        assert_versions_never_reused(read_rows(out), steps)


def test_a_run_that_cannot_reach_a_service_ends_in_one_line_naming_it(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    done = subprocess.run([*lorarl_command(), "train", "examples/demo.yaml", f"output.dir={tmp_path}", "--trainer",
                           nowhere, "--rollout", nowhere, "--weightsync", nowhere], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "LORARL_AUTH_TOKEN": "t"})
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"lorarl: run failed: trainer at {nowhere}: CreateJob failed with UNAVAILABLE")
    assert "Traceback" not in done.stderr
