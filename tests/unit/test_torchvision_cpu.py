"""The index's CUDA-linked torchvision imports beside the CPU torch only through lorarl's .pth hook.

Each case is a fresh interpreter of this virtualenv, since the hook acts at the first `import torchvision`.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from lorarl.common import torchvision_cpu


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_setup_wrote_the_hook_into_site_packages() -> None:
    pth = Path(sysconfig.get_paths()["purelib"]) / torchvision_cpu.PTH_NAME
    assert pth.read_text() == torchvision_cpu.PTH_LINE
    assert sorted([pth.name, "__editable__.lorarl-0.1.0.pth"])[-1] == pth.name  # read after lorarl's path


def test_with_the_hook_torchvision_imports_and_its_missing_ops_say_why() -> None:
    done = run("import torch, torchvision.ops, torchvision.transforms.v2\n"
               "from lorarl.common import torchvision_cpu as t\n"
               "try:\n"
               "    torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
               "except RuntimeError as e:\n"
               "    print('has_ops', torchvision.extension._has_ops(), 'defined', t._library is not None, e)\n"
               "else:\n"
               "    print('has_ops', torchvision.extension._has_ops())\n")
    assert done.returncode == 0, done.stderr[-2000:]
    if "has_ops True" in done.stdout:  # a torchvision whose compiled ops load (a CPU build): nothing to do
        return
    assert "has_ops False defined True" in done.stdout and "Couldn't load custom C++ ops" in done.stdout


def test_without_the_hook_the_cuda_build_does_not_import() -> None:
    done = run("from lorarl.common import torchvision_cpu as t\nt.uninstall()\nimport torchvision\n"
               "print('has_ops', torchvision.extension._has_ops())")
    if "has_ops True" in done.stdout:
        return
    assert done.returncode != 0 and "operator torchvision::nms does not exist" in done.stderr, done.stderr[-2000:]


def test_the_hook_waits_for_torchvision_and_imports_nothing_before() -> None:
    done = run("import sys\nprint(sorted(m for m in ('torch', 'torchvision') if m in sys.modules),"
               " [type(f).__name__ for f in sys.meta_path][0])")
    assert done.returncode == 0 and done.stdout.split() == ["[]", "_FirstImport"], done.stdout + done.stderr
