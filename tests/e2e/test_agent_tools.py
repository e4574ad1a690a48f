"""examples/agent-tools.yaml end to end: the calculator agent (plain openai-client code on the rollout's OpenAI-
compatible endpoint) learns to call the tool and copy its result. The first 20 of the example's 40 steps (the 40
cost the suite 2.5 more minutes, #29): the held-out success must rise by at least 24 points. The job is async and
its sampling is not reproducible from run to run, so the floor sits below every run seen and within ~10 points of
the healthy range (issue "the first hour"): eight 20-step runs here gained +33.5 to +43.0, and one in CI, beside
the suite's other worker, +24.5 (its step-10 evaluation was +30); the whole example's 40 steps: +51.5 and +58.5
(bench/RESULTS.md). A job whose learning breaks gains about nothing. The
loop's time is printed for the record."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lorarl.client.launch.local import lorarl_command

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def test_the_calculator_agent_learns_to_call_and_copy(tmp_path: Path) -> None:
    done = subprocess.run([*lorarl_command(), "run", "examples/agent-tools.yaml", f"output.dir={tmp_path}",
                           f"loop.steps={STEPS}", "output.tensorboard=false", "output.progress=false", "--fresh"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    print(f"held-out success {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f} in "
          f"{evals[-1]['time_s']:.0f} s of loop")
    # 20-step runs: +39.5, +40.0, +40.5, +43.0 (at 7810d04); +40.5, +38.5, +33.5, and +37.0 with a busy-looping
    # process beside it (at 6644f37, 2026-12-05, 2-core x86_64); +24.5 in CI's run of 6644f37
    assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= 0.24, evals
    assert all(r["rollout/context_tokens"] > 0 for r in steps)  # the tool's replies, masked
    assert all(r["train/tokens"] == r["rollout/tokens"] for r in steps)
    # every step of a healthy agent job: the served-policy guard probed every version it could (the last one's
    # activation outlives the last step's record) and never fired, nor did the mismatch alarm
    assert len(steps) == STEPS and sorted(r["policy/guard_version"] for r in steps[1:])[-1] >= STEPS - 1
    assert all(r["policy/guard_alarm"] == 0 and r["policy/guard_abs_diff"] < 1e-3 for r in steps[1:])
    assert all(r["policy/mismatch_alarm"] == 0 for r in steps)
