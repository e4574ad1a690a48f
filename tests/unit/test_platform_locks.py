"""The platform lock files (tools/lock_platforms.py) agree with their inputs and with pyproject's extras,
checked offline: every requirement they were resolved from is met by the locked versions, the inputs
have not changed since (their sha256 is in the lock's header), and on Ascend lorarl's requirements leave
the image's NPU stack as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tools import lock_platforms

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"


def entries(path: Path) -> list[Requirement]:
    lines = [line.split(" --hash")[0].strip() for line in path.read_text().splitlines()]
    return [Requirement(line) for line in lines if line and not line.startswith("#")]


def locked(platform: str) -> dict[str, Version]:
    pins = {}
    for req in entries(REQ / lock_platforms.PLATFORMS[platform].lock):
        (spec,) = req.specifier
        assert spec.operator == "==", f"{req} is not an exact pin"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


@pytest.mark.parametrize("platform", sorted(lock_platforms.PLATFORMS))
def test_each_lock_is_current_and_meets_every_requirement_it_was_resolved_from(platform: str) -> None:
    spec = lock_platforms.PLATFORMS[platform]
    text = (REQ / spec.lock).read_text()
    assert f"# inputs-sha256: {lock_platforms.inputs_digest(spec)}" in text, (
        f"{spec.lock} was resolved from other inputs than {[p.name for p in spec.inputs()]}: "
        "run `make lock-platforms`")
    pins = locked(platform)
    assert all("--hash=sha256:" in line for line in text.splitlines() if line and not line.startswith("#"))
    for name in (*spec.requirements, *spec.constraints):
        for req in entries(REQ / name):
            if req.marker is not None and not req.marker.evaluate():
                continue
            key = canonicalize_name(req.name)
            if name in spec.constraints and key not in pins:
                continue  # a constraint only binds what gets installed
            assert key in pins, f"{spec.lock} has no {req.name} ({name})"
            assert req.specifier.contains(pins[key], prereleases=True), (
                f"{spec.lock}: {key}=={pins[key]}, {name}: {req}")


def test_the_cuda_lock_holds_the_pinned_gpu_stack() -> None:
    pins = locked("cuda")
    assert (pins["torch"], pins["vllm"], pins["megatron-core"]) == (Version("2.13.0"), Version("0.32.0"),
                                                                     Version("0.16.1"))
    assert not str(pins["torch"]).endswith("+cpu")  # PyPI's CUDA build, not this machine's CPU wheel


def test_on_ascend_lorarl_adds_to_the_image_stack_and_replaces_none_of_it() -> None:
    image = {canonicalize_name(r.name): r for r in entries(REQ / "ascend-image.txt")}
    assert {"torch", "torch-npu", "vllm", "vllm-ascend", "transformers"} <= image.keys()
    pins = locked("ascend")
    assert not ({"torch", "torch-npu", "vllm", "vllm-ascend", "transformers", "torchvision"} & pins.keys()), (
        "lorarl's requirements pull in a package of the image's NPU stack")
    assert pins["fastapi"] in image["fastapi"].specifier  # vllm-ascend 0.23 needs fastapi < 0.124
    dockerfile = (ROOT / "deploy/docker/Dockerfile.ascend").read_text()
    assert "-r requirements/base.txt -r requirements/ascend.txt -c requirements/ascend-image.txt" in dockerfile
