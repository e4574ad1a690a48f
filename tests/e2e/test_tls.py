"""End to end across services that require mutual TLS (real processes on loopback, real certificates).

Every service serves TLS and demands a client certificate; the trainer and the rollout reach weight
sync with certificates of their own (server.peer_tls); `lorarl train` connects with --tls-*. The job
trains and its versions reach the rollout. A plaintext client and one whose certificate another CA
signed are refused, each in one line naming the service."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lorarl.client.job.config import load_job_config
from lorarl.client.launch.local import lorarl_command
from lorarl.client.launch.services import local_stack
from tests.integration.tls_certs import make_pki

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
JOB = [f"loop.steps={STEPS}", "loop.mode=sync", "loop.eval_every=0", "data.eval_size=16", "output.tensorboard=false",
       "output.progress=false", "recovery.enabled=false"]


def test_a_job_runs_across_services_that_require_mutual_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    out = tmp_path / "run"
    cfg = load_job_config(str(ROOT / "examples/demo.yaml"), [*JOB, f"output.dir={out}"])
    stack = local_stack(cfg, out)
    tls = {"tls": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), "client_ca_file": str(pki.ca)},
           "peer_tls": {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}}
    stack.server_sections = {name: {**stack.server_sections.get(name, {}), **tls}
                             for name in ("weightsync", "trainer", "rollout")}
    with stack:
        base = [*lorarl_command(), "train", "examples/demo.yaml", *JOB, f"output.dir={out}",
                "--trainer", stack.address("trainer"), "--rollout", stack.address("rollout"),
                "--weightsync", stack.address("weightsync"), "--token-file", str(stack.token_file)]

        def train(*flags: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*base, *flags], cwd=ROOT, env=stack.env(), capture_output=True, text=True,
                                  timeout=400)

        for refused in (train(), train("--tls-ca", str(pki.ca), "--tls-cert", str(pki.rogue_cert),
                                       "--tls-key", str(pki.rogue_key))):
            assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
            lines = refused.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"lorarl: run failed: trainer at "
                                                           f"{stack.address('trainer')}: CreateJob failed"), lines
        done = train("--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key),
                     "--fresh")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        weightsync_log = (out / "services" / "weightsync.log").read_text(errors="replace")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["sync/version"] for r in steps] == list(range(1, STEPS + 1))
    for version in range(1, STEPS + 1):  # the trainer and the rollout reached weight sync over mutual TLS
        assert f"round demo v{version} active on rollout-0" in weightsync_log, weightsync_log[-3000:]
