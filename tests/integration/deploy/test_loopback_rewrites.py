"""The loopback run changes only addresses, ports and paths of the compose services, nothing else:
otherwise test_compose_loopback would prove something about a different system."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.integration.deploy.loopback import LOOPBACK, Loopback
from tools.compose_check import ROOT
from tools.compose_file import load

COMPOSE = ROOT / "deploy" / "docker-compose.yml"
REWRITTEN_ENV = {"LORARL_TRAINER__WEIGHTSYNC_ADDRESS", "LORARL_TRAINER__SENDER_HOST",
                 "LORARL_ROLLOUT__WEIGHTSYNC_ADDRESS", "LORARL_ROLLOUT__SYNC_HOST"}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "lorarl.token"
    path.write_text("t")
    return path


@pytest.fixture
def loopback(tmp_path: Path, token_file: Path) -> Loopback:
    return Loopback(load([COMPOSE], {"LORARL_TOKEN_FILE": str(token_file)}), tmp_path)


def test_environment_changes_only_addresses(loopback: Loopback) -> None:
    for name, service in loopback.project["services"].items():
        compose_env = {k: str(v) for k, v in service["environment"].items()}
        local_env = loopback.environment(name)
        changed = {k for k, v in compose_env.items() if local_env[k] != v}
        assert changed <= REWRITTEN_ENV, (name, changed)
        for key in changed:
            assert local_env[key].split(":")[0] == LOOPBACK
        assert not {k for k in local_env if k.startswith("LORARL_")} - set(compose_env)


def test_commands_change_only_addresses_paths_and_the_executable(loopback: Loopback, tmp_path: Path,
                                                                  token_file: Path) -> None:
    client = loopback.project["services"]["client"]["command"]
    local = loopback.command("client")
    assert local[0].endswith("lorarl") and len(local) == len(client) + 1
    differences = [(a, b) for a, b in zip(client, local[1:], strict=True) if a != b]
    assert differences == [("output.dir=/app/runs/demo", f"output.dir={tmp_path}/volumes/runs/demo"),
                           *[(f"{host}:{port}", f"{LOOPBACK}:{loopback.ports[port]}")
                             for host, port in (("trainer", 50051), ("rollout", 50052), ("weightsync", 50053))],
                           ("/run/secrets/lorarl_token", str(token_file))]


def test_config_files_change_only_host_ports_and_paths(loopback: Loopback, token_file: Path) -> None:
    words = loopback.command("rollout")
    local = yaml.safe_load(Path(words[words.index("--config") + 1]).read_text())
    original = yaml.safe_load((ROOT / "deploy" / "config" / "rollout.yaml").read_text())
    assert local["rollout"] == {**original["rollout"], "model_path": str(ROOT / "lorarl/assets/models/qwen3-tiny")}
    assert local["server"] == {**original["server"], "host": LOOPBACK, "port": loopback.ports[50052],
                               "metrics_port": loopback.ports[9452],
                               "auth": {**original["server"]["auth"], "token_file": str(token_file)}}
    assert len(set(loopback.ports.values())) == 6  # three gRPC and three metrics ports, all distinct
