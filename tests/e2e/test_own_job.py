"""A user's own job, end to end on the real services: a parquet dataset with its own column names and an
extra column, a reward f(prompt, completion, **columns) and a two-turn workflow kept beside the job file,
run by `lorarl run` from another folder with no PYTHONPATH. The trainer gets the workflow's tokens with
the environment's turn masked; then a second job starts from the first one's exported adapter (warm
start) and serves it as version 1 before its first step."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from lorarl.assets.paths import DENSE_MODEL_DIR
from lorarl.assets.tasks import load_split
from lorarl.client.launch.local import lorarl_command

EXPERTS = Path(__file__).resolve().parent / "distill_experts"  # RL experts on the shipped base (test_distill.py)
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

REWARD = '''
def score(prompt, completion, answer, difficulty, **columns):
    """1 for the gold digits anywhere in the last turn; sees the row's own columns."""
    assert isinstance(difficulty, int) and isinstance(prompt, str)
    return 1.0 if str(answer) in completion else 0.0
'''

WORKFLOW = '''
from lorarl.client.workflow import Episode, Workflow


class AskTwice(Workflow):
    """The policy answers, a user turn asks it to check, it answers again; the last answer is scored."""

    def __init__(self, recheck: str = "Check it.") -> None:
        self.recheck = recheck

    async def run(self, ctx, example):
        prompt = ctx.prompt_ids(example)
        first = await ctx.sample(prompt, n=ctx.group_size)
        episodes = []
        for turn in first:
            episode = Episode(prompt)
            episode.add_policy(turn)
            episode.add_context(ctx.render_followup([{"role": "user", "content": self.recheck}]))
            (second,) = await ctx.sample(episode.token_ids, n=1, max_tokens=6)
            episode.add_policy(second)
            (episode.reward,) = await ctx.score(example, [second.text])
            episodes.append(episode)
        return episodes
'''


def write_job(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for split, name in (("train", "train.parquet"), ("test", "test.parquet")):
        problems = load_split(split)[:64]
        pd.DataFrame({"question": [p.prompt for p in problems], "solution": [p.answer for p in problems],
                      "difficulty": [len(p.prompt) % 3 for p in problems]}).to_parquet(folder / name)
    (folder / "myreward.py").write_text(REWARD)
    (folder / "myworkflow.py").write_text(WORKFLOW)
    (folder / "job.yaml").write_text(json.dumps({
        "job_id": "mine", "model": {"path": str(DENSE_MODEL_DIR), "dtype": "float32"},
        "data": {"source": "datasets", "train_path": "train.parquet", "test_path": "test.parquet",
                 "columns": {"prompt": "question", "answer": "solution"}, "reward": "myreward:score",
                 "eval_size": 16},
        "workflow": {"name": "myworkflow:AskTwice", "settings": {"recheck": "Check your digits."}},
        "rollout": {"group_size": 4, "max_tokens": 8, "block_size": 16},
        "trainer": {"lora": {"rank": 8, "alpha": 16}},
        "loop": {"mode": "sync", "steps": 2, "prompts_per_step": 4, "eval_every": 0},
        "sync": {"mode": "adapter"}, "output": {"tensorboard": False, "progress": False}}))
    return folder / "job.yaml"


def run(job: Path, cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.run([*lorarl_command(), "run", str(job), *overrides], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_users_data_reward_and_workflow_train_and_a_second_job_starts_from_the_first(tmp_path: Path) -> None:
    job = write_job(tmp_path / "myjob")
    first_out = tmp_path / "first"
    done = run(job, tmp_path, f"output.dir={first_out}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [r for r in rows(first_out) if "rollout/reward_mean" in r]
    assert [r["sync/version"] for r in steps] == [1, 2]
    for r in steps:
        # the user turn between the two policy turns reached the trainer, masked: it trained on the
        # policy's tokens only (tokens counts what the loss reads)
        assert r["rollout/context_tokens"] > 0
        assert r["train/tokens"] == r["rollout/tokens"]
        assert r["rollout/reward_errors"] == 0
    adapter = first_out / "exports" / "mine" / "final-adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    final_eval = [r for r in rows(first_out) if "eval/accuracy" in r][-1]

    second_out = tmp_path / "second"
    done = run(job, tmp_path, f"output.dir={second_out}", f"trainer.init_adapter={adapter}", "loop.steps=1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    second = rows(second_out)
    first_eval = next(r for r in second if "eval/accuracy" in r)
    assert first_eval["step"] == 0 and first_eval["eval/accuracy"] == final_eval["eval/accuracy"]
    # the warm adapter served as version 1 before any step; the first step published version 2
    assert [r["sync/version"] for r in second if "rollout/reward_mean" in r] == [2]


AGENT = '''
from lorarl.client.workflow import Workflow

TOOLS = [{"type": "function", "function": {"name": "check", "description": "checks an answer",
                                           "parameters": {"type": "object",
                                                          "properties": {"answer": {"type": "string"}}}}}]


class Agent(Workflow):
    """Agent code as written for any OpenAI endpoint: ask, let a tool reply, ask again; trained from the
    session's exact tokens."""

    async def run(self, ctx, example):
        client = ctx.openai_client()
        messages = [{"role": "user", "content": example.prompt}]
        first = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS,
                                                     max_tokens=8, temperature=1.0)
        reply = first.choices[0].message
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "none", "content": "try again"}]
        second = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS,
                                                      max_tokens=6, temperature=1.0)
        (episode,) = await ctx.session_episodes()
        (episode.reward,) = await ctx.score(example, [second.choices[0].message.content or ""])
        return [episode]
'''


def test_an_agent_on_the_openai_endpoint_trains_from_its_sessions_exact_tokens(tmp_path: Path) -> None:
    """...and, distilling beside its reward (distill_weight), every turn it samples on the endpoint is scored by
    its teacher (an adapter on the same base, in the same engine) and trained toward it."""
    job = write_job(tmp_path / "agentjob")
    (tmp_path / "agentjob" / "myagent.py").write_text(AGENT)
    settings = json.loads(job.read_text())
    settings["trainer"]["loss"] = {"type": "grpo", "distill_weight": 0.5}
    job.write_text(json.dumps({**settings, "workflow": {"name": "myagent:Agent"}, "distill": {
        "route": "mixture", "teachers": [{"name": "adder", "adapter": str(EXPERTS / "add")}]}}))
    out = tmp_path / "out"
    done = run(job, tmp_path, f"output.dir={out}", "rollout.openai=true",
               "sync.mode=adapter", "loop.mode=async", "loop.max_staleness=1", "loop.steps=3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [r for r in rows(out) if "rollout/reward_mean" in r]
    assert [r["sync/version"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["rollout/context_tokens"] > 0  # the tool's reply, between the two policy turns, masked
        assert r["train/tokens"] == r["rollout/tokens"] > 0
        assert r["rollout/reward_errors"] == 0
    # versions stayed pinned per episode: what the agent sampled came from the version its batch started on
    assert all(r["rollout/unpinned_samples"] == 0 for r in steps)
    assert "teacher adder serves as" in done.stdout
    for r in steps:  # the sessions' turns came back scored: the trainer refuses a distilling batch without them
        assert r["distill/mixture/prompt_share"] == 1.0 and r["distill/teacher_seconds"] > 0  # route: mixture
        # near 0 here: on these tool-chat prompts the add expert reads the tokens almost as the base does
        assert abs(r["distill/mixture/reverse_kl"]) < 5 and abs(r["train/distill_reverse_kl"]) < 5
