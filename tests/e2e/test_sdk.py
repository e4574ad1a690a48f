"""The Python SDK (lorarl.client.sdk) on real services: the training and sampling clients call by call, the
Tinker-style example script learns, and RLJob(...).run() reproduces `lorarl run`'s curve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lorarl.client.calls import ServiceCallError
from lorarl.client.launch.local import lorarl_command
from lorarl.client.sdk import RLJob, ServiceClient, local_services
from lorarl.client.workflow import Episode

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples/demo.yaml")


def test_the_training_and_sampling_clients_call_by_call(tmp_path: Path) -> None:
    settings = ["job_id=sdk-calls", f"output.dir={tmp_path}", "loop.mode=sync"]
    with local_services(DEMO, settings) as services:
        trainer = services.training_client(DEMO, settings)
        assert (trainer.version, trainer.step) == (0, 0)
        prompt, samples = services.sampling_client().sample("12+34=", n=4, max_tokens=6, seed=3)
        assert len(samples) == 4 and all(set(s.versions) == {0} for s in samples)
        as_dicts = [{"prompt_ids": prompt, "completion_ids": s.token_ids, "logprobs": s.logprobs,
                     "versions": s.versions, "reward": float(i % 2), "group_id": "g"} for i, s in enumerate(samples)]
        episode = Episode(prompt, group_id="h")
        episode.add_policy(samples[0])
        episode.add_context([10, 11])
        episode.add_policy(samples[1])
        policy = trainer.compute_logprobs(as_dicts)
        assert policy == trainer.compute_logprobs(as_dicts, reference=True)  # version 0: the adapter is the identity
        assert [lp for lp in policy[0]] == pytest.approx(samples[0].logprobs, abs=1e-4)  # the rollout's, here too
        metrics = trainer.forward_backward([*as_dicts, episode])
        assert metrics["loss"] == metrics["loss"] and metrics["sequences"] == 5
        saved = trainer.save_state("before-step")
        trainer.optim_step()
        assert trainer.version == 1 and trainer.compute_logprobs(as_dicts) != policy
        assert trainer.publish() == 1
        _, after = services.sampling_client(trainer.job_id).sample(prompt, n=2, max_tokens=4)
        assert all(set(s.versions) == {1} for s in after)
        assert trainer.load_state(saved) == 0 and trainer.compute_logprobs(as_dicts) == policy
        assert Path(trainer.export(mode="adapter"), "adapter_model.safetensors").is_file()
    with pytest.raises(ServiceCallError, match=r"trainer at 127\.0\.0\.1:9: CreateJob failed with UNAVAILABLE"):
        ServiceClient(trainer="127.0.0.1:9", token="t").training_client(DEMO)


def test_the_tinker_style_example_learns() -> None:
    done = subprocess.run([sys.executable, "examples/sdk/finetune.py", "20"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before = float(re.search(r"accuracy before: ([\d.]+)", done.stdout).group(1))
    after = float(re.search(r"accuracy after:\s+([\d.]+)", done.stdout).group(1))
    # within ~10 points of healthy runs (issue "the first hour"): 0.360 -> 0.733 (+37.3) in 20 steps, both of two
    # runs (2026-12-07, 90ce2ec with stop 52's changes, this 2-core machine)
    assert after - before >= 0.28, done.stdout


def test_rljob_reproduces_lorarl_runs_curve(tmp_path: Path) -> None:
    settings = ["loop.mode=sync", "loop.steps=2", "loop.eval_every=1", "data.eval_size=16", "output.tensorboard=false",
                "output.progress=false"]
    rows = RLJob(DEMO, [*settings, f"output.dir={tmp_path / 'sdk'}"], fresh=True).run()
    done = subprocess.run([*lorarl_command(), "run", DEMO, *settings, f"output.dir={tmp_path / 'cli'}", "--fresh"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cli = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]

    def curve(table: list[dict]) -> list[tuple]:
        return [(r["step"], r.get("rollout/reward_mean"), r.get("eval/accuracy"), r.get("sync/version"))
                for r in table]

    assert curve(rows) == curve(cli) and len([r for r in rows if "rollout/reward_mean" in r]) == 2
