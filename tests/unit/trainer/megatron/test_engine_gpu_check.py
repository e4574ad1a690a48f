"""bench/megatron_gpu_check.py runs on CPU with small sizes, so the prepared GPU check never rots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[4] / "bench" / "megatron_gpu_check.py"


@pytest.mark.slow
def test_gpu_check_passes_its_cpu_smoke_run() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith(("PASS", "FAIL"))]
    assert len(lines) == 7 and all(line.startswith("PASS") for line in lines), lines
    assert "megatron / torch" not in result.stdout and "ratio" in result.stdout
