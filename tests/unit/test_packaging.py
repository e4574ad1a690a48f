"""What a wheel built from the repo installs: one import root, lorarl, with its data files and entry points."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, cwd=build, env={"PIP_NO_INDEX": "1", "PATH": "/usr/bin:/bin",
                                                        "HOME": str(build), "TMPDIR": str(build)})
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("lorarl-*.whl")
    return zipfile.ZipFile(path)


def top_level_names(wheel: zipfile.ZipFile) -> set[str]:
    return {name.split("/", 1)[0] for name in wheel.namelist() if ".dist-info/" not in name}


def test_the_wheel_installs_only_the_lorarl_import_root(wheel: zipfile.ZipFile) -> None:
    assert top_level_names(wheel) == {"lorarl"}
    names = set(wheel.namelist())
    for module in ("lorarl/__init__.py", "lorarl/v1/trainer_pb2.py", "lorarl/trainer/service/server.py",
                   "lorarl/rollout/vllm/plugin.py", "lorarl/weightsync/client/agent.py", "lorarl/client/cli.py"):
        assert module in names
    assert not any(n.startswith(("lorarl/bench", "lorarl/tests")) for n in names)


def test_the_wheel_carries_the_shipped_models_and_its_entry_points(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "lorarl/assets/models/qwen3-tiny/config.json" in names
    assert any(n.startswith("lorarl/assets/models/qwen3-tiny/") and n.endswith(".safetensors") for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "lorarl = lorarl.client.cli:main" in text
    assert "lorarl = lorarl.rollout.vllm.plugin:register" in text
