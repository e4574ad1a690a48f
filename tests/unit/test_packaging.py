"""What a wheel built from the repo installs: one import root, lorarl, with its data files and entry points."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


#: What the build reads: the wheel is built from a copy of these, never in the checkout. setuptools builds
#: in the source tree's build/, so a build there could pack modules a checkout left in build/lib and race
#: with anything else writing the tree (CI saw `[Errno 2] No such file or directory` mid-build once).
SOURCES = ("pyproject.toml", "README.md", "requirements", "lorarl")


def source_copy(into: Path) -> Path:
    """The files a wheel is built from, copied without caches, build outputs or egg-info."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, into / name, ignore=skip)
        else:
            shutil.copy2(src, into / name)
    return into


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    source = source_copy(tmp_path_factory.mktemp("source"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
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
