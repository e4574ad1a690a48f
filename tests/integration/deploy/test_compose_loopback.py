"""deploy/docker-compose.yml and `lorarl run` are one system: each compose service's own command and
environment, run as a local process on loopback (see loopback.py for the only rewrites), trains.

No Docker engine runs here, so this is the closest proof that the stack works: the services start
in `depends_on` order, each becomes healthy by its own compose healthcheck, and the client
service's command runs a short demo job whose adapters reach the rollout over gloo.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

import pytest

from tests.integration.deploy.loopback import Loopback, LoopbackStack
from tools.compose_file import load, start_order

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
STEPS = 2
#: Only the job's length and the amount of evaluation are cut; everything else is the compose command's.
SHORT_JOB = [f"loop.steps={STEPS}", "loop.eval_every=0", "data.eval_size=16", "output.tensorboard=false",
             "output.progress=false"]


def with_overrides(argv: list[str], overrides: list[str]) -> list[str]:
    """Dotted overrides placed after the positional ones, before the first --flag."""
    first_flag = next(i for i, word in enumerate(argv) if word.startswith("--"))
    return [*argv[:first_flag], *overrides, *argv[first_flag:]]


def test_compose_services_run_the_demo_job_on_loopback(tmp_path: Path) -> None:
    token_file = tmp_path / "lorarl.token"
    token_file.write_text(secrets.token_hex(16))
    token_file.chmod(0o600)
    project = load([COMPOSE], {"LORARL_TOKEN_FILE": str(token_file)})
    order = start_order(project["services"])
    *servers, client = order
    assert client == "client" and servers == ["weightsync", "trainer", "rollout"]
    loopback = Loopback(project, tmp_path)
    stack = LoopbackStack(loopback)
    try:
        for name in servers:
            stack.start(name)
        result = subprocess.run(with_overrides(loopback.command(client), SHORT_JOB), capture_output=True, text=True,
                                timeout=400, cwd=loopback.working_dir(client), env=loopback.environment(client))
        logs = {name: svc.log_path for name, svc in stack.stack.processes.items()}
    finally:
        exit_codes = stack.stop()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + "".join(
        f"\n--- {name} ---\n{path.read_text(errors='replace')[-2000:]}" for name, path in logs.items())
    assert exit_codes == {name: 0 for name in servers}  # each drained and exited on SIGTERM

    runs = tmp_path / "volumes" / "runs"  # the compose `runs` volume
    rows = [json.loads(line) for line in (runs / "demo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["train/version"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["sync/version"] for r in steps] == list(range(1, STEPS + 1))
    assert len([r for r in rows if "eval/accuracy" in r]) == 2  # before and after
    # Published versions went through the weight-sync service's storage and the trainer's export dir, both
    # on the shared volume, and reached the rollout over the gloo group, not inline gRPC.
    assert (runs / "weightsync" / "jobs" / "demo" / f"v{STEPS:012d}").is_dir()
    assert (runs / "exports" / "demo" / "final-adapter").is_dir()
    weightsync_log = logs["weightsync"].read_text(errors="replace")
    for version in range(1, STEPS + 1):
        assert f"round demo v{version} started: rollout-0(collective rank 1)" in weightsync_log, weightsync_log[-3000:]
        assert f"round demo v{version} active on rollout-0" in weightsync_log, weightsync_log[-3000:]
