"""The calculator agent of examples/calc_agent.py, for tools.yaml: a job's workflow is imported with its job
file's folder first on the import path, and the agent lives one folder up."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from calc_agent import CalcAgent

__all__ = ["CalcAgent"]
