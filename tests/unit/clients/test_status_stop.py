"""`lorarl status RUN_DIR` and `lorarl stop RUN_DIR` on real run directories: a launcher that is a real process
recording itself as `lorarl run` does, a real lorarl server answering health, addresses nobody listens on. A
folder that is no run directory is exit 2 with what to give instead (the live stack: tests/e2e/test_launcher_exit.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorarl.client.cli import main
from lorarl.client.launch.launcher_record import process_start, read_record, record_path
from lorarl.common.ports import free_port
from lorarl.common.ready import write_ready_file
from lorarl.common.server import start_server
from lorarl.common.server_config import ServerConfig

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "t0ken-for-this-run"

#: A launcher as `lorarl run` is one for `lorarl stop`: recorded while it runs, SIGTERM ends it as Ctrl-C does.
LAUNCHER = """
import signal, sys, time
from pathlib import Path
from lorarl.client.launch.launcher_record import launcher_recorded

def interrupt(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "deaf" else interrupt)
try:
    with launcher_recorded(Path(sys.argv[1])):
        print("recorded", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    sys.exit(130)
"""


def run_dir(tmp_path: Path) -> Path:
    """A run directory as `lorarl run` leaves it mid-run: settings, a resume point, metrics, the services' files."""
    out = tmp_path / "run"
    (out / "services").mkdir(parents=True)
    (out / "resume_config.json").write_text(json.dumps({"job_id": "demo", "model": {"path": "Qwen/Qwen3-0.6B"},
                                                        "loop": {"steps": 40}}))
    (out / "state.json").write_text(json.dumps({"step": 10, "version": 11, "cursor": 160,
                                                "checkpoint": str(out / "checkpoints/demo/resume")}))
    rows = [{"step": 11, "rollout/reward_mean": 0.25}, {"step": 12, "rollout/reward_mean": 0.5, "train/loss": 0.125}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 13, "rollo')
    (out / "services" / "token").write_text(TOKEN)
    return out


def ready(out: Path, name: str, address: str, pid: int) -> None:
    write_ready_file(out / "services" / f"{name}.ready.json", {"service": name.split("-")[0], "pid": pid,
                                                               "address": address, "tls": False})


@contextlib.contextmanager
def serving(token_file: Path) -> Iterator[str]:
    """A lorarl server on loopback that answers health (and the run's token), serving no lorarl service."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = ServerConfig(port=0, metrics_port=-1)
    config.auth.token_file, config.auth.required = str(token_file), True
    running = asyncio.run_coroutine_threadsafe(start_server("trainer", config, lambda server: []), loop).result(10)
    try:
        yield running.address
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def status(run: Path, capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["status", str(run), "--timeout", "1", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", ["status", "stop"])
def test_a_folder_that_is_no_run_directory_is_exit_2_saying_what_to_give(command: str, tmp_path: Path,
                                                                           capsys) -> None:
    assert main([command, str(tmp_path / "nowhere")]) == 2
    assert "does not exist; give a job's run directory (its output.dir" in capsys.readouterr().err
    assert main([command, str(tmp_path)]) == 2
    assert "is not a run directory: it holds none of what `lorarl run` writes" in capsys.readouterr().err
    assert main([command, str(ROOT / "examples/demo.yaml")]) == 2
    assert "is a job file; give its run directory, the folder its output.dir names (runs/demo)" in \
        capsys.readouterr().err


def test_status_of_a_run_whose_services_are_gone(tmp_path: Path, capsys) -> None:
    out = run_dir(tmp_path)
    gone = f"127.0.0.1:{free_port()}"
    for name in ("weightsync", "trainer", "rollout-0"):
        ready(out, name, gone, 999_999)
    code, text, _ = status(out, capsys)
    assert code == 0
    lines = dict(line.split(None, 1) for line in text.splitlines())
    assert lines["run"] == f"{out}: job demo, model Qwen/Qwen3-0.6B"
    assert lines["launcher"] == "not running"
    assert lines["services"] == f"not answering (last at weightsync {gone}, trainer {gone}, rollout-0 {gone})"
    assert lines["resume"] == f"step 10 of 40 (version 11, data cursor 160); checkpoint {out}/checkpoints/demo/resume"
    assert lines["metrics"] == "step 12: rollout/reward_mean 0.5, train/loss 0.125"  # the half-written line is not one
    assert lines["weightsync"] == lines["trainer"] == "not answering (not serving)"
    code, text, _ = status(out, capsys, "--json")
    report = json.loads(text)
    assert (report["services_up"], report["resume"]["step"], report["metrics"]["step"]) == (False, 10, 12)
    assert [s["name"] for s in report["services"]] == ["weightsync", "trainer", "rollout-0"]


def test_status_of_a_run_whose_services_answer(tmp_path: Path, capsys) -> None:
    out = run_dir(tmp_path)
    with serving(out / "services" / "token") as address:
        ready(out, "trainer", address, os.getpid())
        code, text, _ = status(out, capsys, "--json")
    report = json.loads(text)
    assert code == 0 and report["services_up"] is True
    assert report["services"] == [{"name": "trainer", "service": "trainer", "address": address, "pid": os.getpid(),
                                   "tls": False, "up": True}]
    # it answers, with the run's token, but serves no TrainerService: said, not raised
    assert report["trainer"] == {"address": address, "answering": False,
                                 "error": "UNIMPLEMENTED: Method not found!"}
    assert report["weightsync"] == {"answering": False, "error": "none recorded"}


def launcher(out: Path, mode: str = "obedient") -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(out / "services"), mode], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "recorded"
    return process


def test_stop_ends_the_recorded_launcher_and_says_so(tmp_path: Path, capsys) -> None:
    out = run_dir(tmp_path)
    process = launcher(out)
    try:
        code, text, _ = status(out, capsys)
        assert code == 0
        assert f"launcher   running: pid {process.pid}, started " in text
        assert main(["stop", str(out), "--timeout", "10"]) == 0  # our child: a zombie until waited, yet gone
        said = capsys.readouterr().out
        assert f"stopping pid {process.pid}" in said and "stopped in " in said
        assert process.wait(5) == 130  # it left as on Ctrl-C, and removed its record on the way out
        assert not record_path(out / "services").exists()
        assert main(["stop", str(out)]) == 0
        assert "nothing to stop: no `lorarl run` is recorded as running" in capsys.readouterr().out
    finally:
        process.kill()


def test_a_launcher_deaf_to_sigterm_is_reported_then_killed_with_kill(tmp_path: Path, capsys) -> None:
    out = run_dir(tmp_path)
    process = launcher(out, "deaf")
    try:
        assert main(["stop", str(out), "--timeout", "0.5"]) == 1
        assert f"the launcher (pid {process.pid}) is still running after 0.5 s" in capsys.readouterr().err
        assert main(["stop", str(out), "--timeout", "0.5", "--kill"]) == 0
        assert f"killed pid {process.pid}" in capsys.readouterr().out
        assert process.wait(5) == -9
        assert read_record(out / "services") is not None  # a SIGKILLed launcher cleans nothing up: stale now
        code, text, _ = status(out, capsys)
        assert code == 0
        assert f"not running (stale record: pid {process.pid} is gone)" in text
        assert main(["stop", str(out)]) == 0
        assert "is gone; removed its stale record" in capsys.readouterr().out
        assert not record_path(out / "services").exists()
    finally:
        process.kill()


def test_a_record_whose_pid_now_names_another_process_is_stale(tmp_path: Path, capsys) -> None:
    out = run_dir(tmp_path)
    start = process_start(os.getpid())
    assert start is not None
    write_ready_file(record_path(out / "services"), {"pid": os.getpid(), "started_at": 0.0,
                                                     "process_start": start - 1, "command": ["run", "job.yaml"]})
    assert main(["stop", str(out)]) == 0  # this test's own process is not signalled
    assert f"(pid {os.getpid()}, started " in (said := capsys.readouterr().out)
    assert "now names another process (started later); removed its stale record" in said
