"""Nothing left behind: each launcher (`lorarl run`, `lorarl run A B`, `lorarl tinker`, `lorarl eval`), killed by
SIGKILL (the OOM killer, a lost SSH session: it can stop nothing) or stopped by SIGTERM (a supervisor) once its
services are up, leaves within 15 s no process it started — services, `lorarl train` jobs, vLLM's engine core —
and no file in shared memory of theirs (a /dev/shm entry that is new and names lorarl or one of their pids; the
`lorarl run` case is co-located, and no process holds its shared base any more). `lorarl status RUN_DIR` says its
services are up, at their addresses, while they are, and its launcher's record stale once it is SIGKILLed;
`lorarl stop RUN_DIR` stops a `lorarl run` as a supervisor's SIGTERM does, leaving nothing behind either.

The services watch their launcher (lorarl.common.parent_watch) and stop as on SIGTERM when it is gone. The real
vLLM engine runs in the `lorarl run` case (its engine core is a child of the rollout); the others run the HF
engine, which starts in seconds, to keep the file's time down."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 15.0
QUIET = ["output.tensorboard=false", "output.progress=false"]
MULTITENANT = ROOT / "examples" / "multitenant"
SHM = "/dev/shm"


def lorarl(*args: str) -> list[str]:
    return [sys.executable, "-m", "lorarl.client.cli", *args]


def launchers(out: Path) -> dict[str, tuple[list[str], Path]]:
    """name -> (command, the stack.json that says its services are up)."""
    from tests.e2e.test_multitenant import job_file

    out.mkdir(parents=True)
    many = [str(job_file(out, name)) for name in ("tools", "sort")]  # each with its output dir under ``out``
    return {
        "run": (lorarl("run", str(ROOT / "examples/demo.yaml"), *QUIET, "placement.colocate=true", f"output.dir={out}"),
                out / "services" / "stack.json"),
        "run-hf": (lorarl("run", str(ROOT / "examples/demo.yaml"), *QUIET, "rollout.engine=hf", f"output.dir={out}"),
                   out / "services" / "stack.json"),
        "tinker": (lorarl("tinker", str(ROOT / "examples/demo.yaml"), "rollout.engine=hf", f"output.dir={out}"),
                   out / "services" / "stack.json"),
        "run-many": (lorarl("run", *many, *QUIET, "rollout.engine=hf"), out / "tools" / "services" / "stack.json"),
        "eval": (lorarl("eval", str(ROOT / "examples/demo.yaml"), "rollout.engine=hf", f"output.dir={out}"),
                 out / "eval" / "services" / "stack.json"),
    }


def shared_base_holders() -> set[int]:
    """The processes holding a co-located job's shared base (an anonymous memory file: it is in no directory, and
    the kernel frees it when no process holds a descriptor or a mapping of it)."""
    holders = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            maps = Path(f"/proc/{pid}/maps").read_text()
            if any(SHARED_BASE in link for link in links) or SHARED_BASE in maps:
                holders.add(int(pid))
    return holders


SHARED_BASE = "memfd:lorarl-shared-base"
CASES = [("run", signal.SIGKILL), ("tinker", signal.SIGTERM), ("tinker", signal.SIGKILL),
         ("run-many", signal.SIGKILL), ("run-many", signal.SIGTERM), ("eval", signal.SIGKILL), ("eval", signal.SIGTERM)]


@contextlib.contextmanager
def launched(tmp_path: Path, launcher: str) -> Iterator[tuple[subprocess.Popen[bytes], list[psutil.Process]]]:
    """The launcher, once its services are up, and the processes it started by then (all killed afterwards)."""
    command, up = launchers(tmp_path / "out")[launcher]
    log = (tmp_path / "launcher.log").open("w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(MULTITENANT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env=env)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 200
        while not up.exists():
            assert process.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the services did not come up"
            time.sleep(0.2)
        started = psutil.Process(process.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()[2:5]) for p in started)
        assert names.count("serve") >= (1 if launcher == "eval" else 3), names
        yield process, started
    finally:
        for p in [psutil.Process(process.pid) if process.poll() is None else None, *started]:
            if p is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        log.close()


def assert_nothing_left(process: subprocess.Popen[bytes], started: list[psutil.Process], shm_before: set[str],
                        how: str) -> None:
    process.wait(timeout=60)
    _, alive = psutil.wait_procs(started, timeout=GONE_WITHIN_S)
    assert not alive, f"left running after {how}: {[p.cmdline()[:6] for p in alive]}"
    pids = {str(p.pid) for p in started} | {str(process.pid)}
    theirs = [name for name in set(os.listdir(SHM)) - shm_before
              if "lorarl" in name or any(pid in name for pid in pids)]
    assert not theirs, f"left in shared memory: {theirs}"


def status(out: Path) -> dict:
    done = subprocess.run(lorarl("status", str(out), "--json", "--timeout", "10"), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(("launcher", "sig"), CASES, ids=[f"{name}-{sig.name}" for name, sig in CASES])
def test_a_launcher_that_dies_leaves_no_process_and_no_shared_memory(tmp_path: Path, launcher: str,
                                                                      sig: signal.Signals) -> None:
    shm_before = set(os.listdir(SHM))
    with launched(tmp_path, launcher) as (process, started):
        if launcher == "run":  # vLLM's engine core, forked by the rollout: a process of its own
            names = " ".join(" ".join(p.cmdline()[2:5]) for p in started)
            assert len(started) >= 4, names
            # co-located (#44): the launcher, the trainer and the rollout's engine core hold the one shared base
            holders = shared_base_holders()
            assert process.pid in holders and len(holders & {p.pid for p in started}) >= 2, (holders, names)
            up = status(tmp_path / "out")  # what `lorarl status` says of a run whose services are up
            assert up["launcher"]["state"] == "running" and up["launcher"]["pid"] == process.pid, up["launcher"]
            assert up["services_up"] and {s["service"] for s in up["services"]} == {"weightsync", "trainer", "rollout"}
            stack = json.loads((tmp_path / "out" / "services" / "stack.json").read_text())
            assert {s["name"]: s["address"] for s in up["services"] if s["name"] == "trainer"} == \
                {"trainer": stack["trainer"]}
            assert up["trainer"]["answering"] and up["weightsync"]["answering"], (up["trainer"], up["weightsync"])
        os.kill(process.pid, sig)
        assert_nothing_left(process, started, shm_before, sig.name)
        if launcher == "run":  # no process holds the shared base any more: the kernel has freed it
            assert not shared_base_holders() & ({p.pid for p in started} | {process.pid})
            down = status(tmp_path / "out")  # a SIGKILLed launcher could remove nothing: its record is stale
            assert down["launcher"]["state"] == "gone" and not down["services_up"], down
        if sig == signal.SIGTERM:  # a supervisor's stop: the launcher itself stops in order, not killed
            assert process.returncode in (0, 130) and "Traceback" not in (tmp_path / "launcher.log").read_text()


def test_lorarl_stop_stops_a_run_as_its_supervisor_would_and_leaves_nothing(tmp_path: Path) -> None:
    shm_before = set(os.listdir(SHM))
    out = tmp_path / "out"
    with launched(tmp_path, "run-hf") as (process, started):
        stopped = subprocess.run(lorarl("stop", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert f"stopping pid {process.pid}" in stopped.stdout and "stopped in " in stopped.stdout, stopped.stdout
        assert_nothing_left(process, started, shm_before, "lorarl stop")
        assert process.returncode == 130 and "Traceback" not in (tmp_path / "launcher.log").read_text()
        assert not (out / "services" / "launcher.json").exists() and not (out / "services" / "token").exists()
        again = subprocess.run(lorarl("stop", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "nothing to stop" in again.stdout, again.stdout + again.stderr
