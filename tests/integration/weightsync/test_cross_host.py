"""Trainer and rollout on different hosts: two network namespaces joined by a veth pair, each with
its own address (10.200.N.1 and 10.200.N.2) and its own loopback. The weight-sync service and the
trainer's sender run in one, the replica in the other; the collective group must form across them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lorarl.common.ready import wait_for_ready_file
from tests.integration.test_service_processes import child_env, lorarl_command
from tests.integration.weightsync.agent_main import tensors_digest
from tests.integration.weightsync.harness import ROOT, TOKEN, ReplicaProcess
from tests.integration.weightsync.tiny import TinyTrainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str, str]]:
    """(trainer namespace, its address, rollout namespace, its address); removed afterwards."""
    tag = os.getpid() % 100000
    subnet = f"10.200.{os.getpid() % 250 + 1}"
    trainer_ns, rollout_ns = f"lorarl-ws-t{tag}", f"lorarl-ws-r{tag}"
    created: list[str] = []
    try:
        for ns in (trainer_ns, rollout_ns):
            made = ip("netns", "add", ns)
            if made.returncode != 0:
                pytest.skip(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
            created.append(ns)
        steps = [
            ("link", "add", f"wst{tag}", "type", "veth", "peer", "name", f"wsr{tag}"),
            ("link", "set", f"wst{tag}", "netns", trainer_ns),
            ("link", "set", f"wsr{tag}", "netns", rollout_ns),
            ("-n", trainer_ns, "addr", "add", f"{subnet}.1/24", "dev", f"wst{tag}"),
            ("-n", rollout_ns, "addr", "add", f"{subnet}.2/24", "dev", f"wsr{tag}"),
            ("-n", trainer_ns, "link", "set", f"wst{tag}", "up"),
            ("-n", rollout_ns, "link", "set", f"wsr{tag}", "up"),
            ("-n", trainer_ns, "link", "set", "lo", "up"),
            ("-n", rollout_ns, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot build the veth pair (`ip {' '.join(step)}`): {done.stderr.strip()}")
        yield trainer_ns, f"{subnet}.1", rollout_ns, f"{subnet}.2"
    finally:
        for ns in created:
            ip("netns", "del", ns)  # takes its end of the veth pair with it


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_collective_transfer_between_two_network_namespaces(two_hosts, tmp_path: Path, mode: str) -> None:
    trainer_ns, trainer_ip, rollout_ns, rollout_ip = two_hosts
    port = 50_000 + os.getpid() % 10_000
    target = f"{trainer_ip}:{port}"
    config = tmp_path / "weightsync.yaml"
    config.write_text(yaml.safe_dump({"server": {"host": trainer_ip, "port": port, "metrics_port": -1,
                                                 "shutdown_grace_s": 0.5},
                                      "weightsync": {"storage_dir": str(tmp_path / "ws")}}))
    in_trainer_ns, in_rollout_ns = ["ip", "netns", "exec", trainer_ns], ["ip", "netns", "exec", rollout_ns]
    env = {**child_env(LORARL_AUTH_TOKEN=TOKEN), "PYTHONPATH": str(ROOT)}
    processes: list[subprocess.Popen] = []
    replica = ReplicaProcess(target, "remote", tmp_path, prefix=in_rollout_ns)
    try:
        ready = tmp_path / "ready.json"
        service = subprocess.Popen([*in_trainer_ns, *lorarl_command(), "serve", "weightsync", "--config", str(config),
                                    "--ready-file", str(ready)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=(tmp_path / "service.log").open("wb"))
        processes.append(service)
        assert wait_for_ready_file(ready, timeout=60, process=service)["address"] == target

        # The namespaces really are apart: the replica's own loopback has no service on that port.
        probe = subprocess.run([*in_rollout_ns, sys.executable, "-c",
                                f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"],
                               capture_output=True, timeout=30)
        assert probe.returncode != 0

        replica.start()
        out = tmp_path / "trainer.json"
        trainer = subprocess.run([*in_trainer_ns, sys.executable, "-m", "tests.integration.weightsync.trainer_main",
                                  "--target", target, "--out", str(out), "--mode", mode, "--versions", "2"],
                                 env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert trainer.returncode == 0, trainer.stderr[-3000:] + replica.log()
        summary = json.loads(out.read_text())
        assert summary["host"] == trainer_ip
        for entry in summary["versions"]:
            assert entry["outcome"] == "active", entry
            assert (entry["transport"], entry["receivers"], entry["send_error"]) == ("collective", 1, "")

        subscribed = replica.events("subscribed")[0]
        assert subscribed["host"] == rollout_ip
        tiny = TinyTrainer()
        for version in (1, 2):
            tiny.step(version)
            staged = replica.events("stage", version=version)[-1]
            assert staged["transport"] == "collective" and staged["master"] == trainer_ip
            want = tiny.adapter() if mode == "adapter" else dict(tiny.merged())
            assert staged["digest"] == tensors_digest(want)
            assert replica.events("commit", version=version)
    finally:
        replica.kill()
        for process in processes:
            process.kill()
            process.wait(timeout=30)
