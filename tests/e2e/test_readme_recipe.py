"""docs/services.md's "Starting each service" block (README links it), run as written: the token file, three
`lorarl serve` with the example configs on their fixed ports, then `lorarl train` on them (shortened with
overrides after its flags, as a user may write them). The job trains, its versions reach the rollout, and no
dtype warning is printed; a rollout started with the checkpoint's other dtype gets the warning."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
SHORT = ["loop.steps=2", "loop.mode=sync", "loop.eval_every=0", "data.eval_size=16", "output.tensorboard=false",
         "output.progress=false"]


def recipe() -> list[str]:
    """The shell lines of the first block of docs/services.md, under its title "Starting each service"."""
    text = (ROOT / "docs" / "services.md").read_text()
    section = text.split("# Starting each service", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_readme_recipe_runs_as_written(tmp_path: Path) -> None:
    lines = recipe()
    serves = [line for line in lines if " serve " in line]
    (train,) = [line for line in lines if " train " in line]
    assert [re.search(r"serve (\w+)", line).group(1) for line in serves] == ["trainer", "rollout", "weightsync"]
    ports = [int(re.search(r"--port (\d+)", line).group(1)) for line in serves]
    setup = "\n".join(line for line in lines if " serve " not in line and " train " not in line)
    env = {**os.environ, "HOME": str(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("LORARL_AUTH_TOKEN", None)
    # One shell: the block's setup (token file, exports), each service in the background, their pids out.
    script = "\n".join([setup, *(f"{line} > {tmp_path}/{i}.log 2>&1 & echo $!" for i, line in enumerate(serves))])
    started = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    pids = [int(p) for p in started.stdout.split()]
    try:
        deadline = time.monotonic() + 300
        while not all(serving(port) for port in ports):
            assert time.monotonic() < deadline, "\n".join((tmp_path / f"{i}.log").read_text()[-2000:] for i in range(3))
            time.sleep(1)
        out = tmp_path / "run"
        exports = "\n".join(line for line in lines if line.startswith("export "))  # the token stays as made
        command = f"{exports}\n{train} {' '.join(SHORT)} output.dir={shlex.quote(str(out))}"
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "warning" not in done.stderr, done.stderr
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        versions = [r["sync/version"] for r in rows if "rollout/reward_mean" in r]
        # weight sync keeps versions in runs/weightsync across runs: numbers go on from an earlier run's
        assert len(versions) == 2 and versions[1] == versions[0] + 1 >= 2
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        for pid in pids:
            for _ in range(60):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
