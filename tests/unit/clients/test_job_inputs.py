"""A user's own data, reward and workflow: read through Hugging Face datasets with every column kept,
rewards of three forms called off the event loop, prompts that are chats by their type, imports from the
job file's folder, and a --dry-run that fails on a missing file or a bad reward before anything starts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from lorarl.assets.paths import DENSE_MODEL_DIR
from lorarl.client.cli import main
from lorarl.client.job.config import load_job_config
from lorarl.client.job.datasets import Example, load_examples
from lorarl.client.job.inputs import job_examples, job_workflow
from lorarl.client.job.rewards import Reward, RewardError, load_reward
from lorarl.common.config import ConfigError
from lorarl.contract.chat import ChatRenderer

ROOT = Path(__file__).resolve().parents[3]

REWARD_MODULE = '''
def score(prompt, completion, answer, level, **columns):
    """A user's reward: sees the prompt, the completion and every column of its row."""
    assert isinstance(answer, int) and "source" in columns
    return float(completion.strip() == str(answer)) + 0.0 * level


async def judge(prompts, completions, answer, **columns):
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]
'''


def write_job(folder: Path, **data: object) -> Path:
    """A job folder as a user makes one: parquet train data with extra columns, JSONL test data with a
    numeric answer and a chat prompt, a reward module beside the job file."""
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"question": ["1+1=", "2+2=", "3+3="], "solution": [2, 4, 6], "level": [1, 2, 3],
                  "source": ["a", "b", "c"]}).to_parquet(folder / "train.parquet")
    (folder / "test.jsonl").write_text("\n".join(json.dumps(row) for row in [
        {"question": [{"role": "user", "content": "5+5="}], "solution": 10, "level": 1, "source": "d"},
        {"question": "[1, 2] looks like JSON", "solution": 3, "level": 2, "source": "e"}]))
    (folder / "myreward.py").write_text(REWARD_MODULE)
    settings = {"source": "datasets", "train_path": "train.parquet", "test_path": "test.jsonl",
                "columns": {"prompt": "question", "answer": "solution"}, "reward": "myreward:score", **data}
    job = folder / "job.yaml"
    job.write_text(json.dumps({"job_id": "mine", "model": {"path": str(DENSE_MODEL_DIR)}, "data": settings}))
    return job


def test_a_users_dataset_and_reward_beside_the_job_pass_the_dry_run_with_no_pythonpath(tmp_path: Path) -> None:
    job = write_job(tmp_path / "myjob")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "lorarl.client.cli", "run", str(job), "--dry-run"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data train: datasets " in done.stdout and "columns ['level', 'question', 'solution', 'source']" \
        in done.stdout
    assert "chat prompts" in done.stdout  # the test split's first prompt is a list of messages
    assert "reward: myreward:score" in done.stdout and done.stdout.rstrip().endswith("config OK")


def test_rows_keep_every_column_and_their_types(tmp_path: Path) -> None:
    cfg = load_job_config(str(write_job(tmp_path / "job")), [])
    train, test = job_examples(cfg, "train"), job_examples(cfg, "test")
    assert train[1] == Example("2+2=", 4, {"question": "2+2=", "solution": 4, "level": 2, "source": "b"})
    assert test[0].prompt == [{"role": "user", "content": "5+5="}] and test[0].answer == 10
    assert test[1].prompt == "[1, 2] looks like JSON"  # a string stays a string: its type decides, not its text
    assert test[0].answer_text() == "10"
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "p", "answer": {"x": [1, 2]}, "extra": True}))
    (row,) = load_examples("jsonl", "train", str(tmp_path / "rows.jsonl"))
    assert row.answer == {"x": [1, 2]} and row.columns["extra"] is True


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["data.test_path=notes.txt"], "data.test_path", "unknown file type '.txt'"),
    (["data.columns.prompt=nope"], "data.train_path", "has no column 'nope'"),
    (["data.reward=nomodule:score"], "data.reward", "cannot import 'nomodule'"),
    (["data.reward=myreward:missing"], "data.reward", "has no 'missing'"),
    (["data.reward=myreward:REWARD_MODULE"], "data.reward", "is not callable"),
    (["workflow.name=myreward:score"], "workflow.name", "is not a lorarl.client.workflow.Workflow subclass"),
    (["workflow.settings.turns=3"], "workflow.settings", "takes no settings"),
])
def test_the_dry_run_fails_on_a_bad_input_naming_its_key(overrides: list[str], key: str, words: str,
                                                         tmp_path: Path, capsys) -> None:
    job = write_job(tmp_path / "job")
    (tmp_path / "job" / "notes.txt").write_text("not data")
    (tmp_path / "job" / "myreward.py").write_text(REWARD_MODULE + "\nREWARD_MODULE = 'text'\n")
    assert main(["run", str(job), "--dry-run", *overrides]) == 2
    out = capsys.readouterr().out
    assert f"lorarl: bad config: {key}:" in out and words in out and "config OK" not in out, out


def test_a_missing_data_file_is_a_warning_of_the_plan_and_refused_by_run(tmp_path: Path, capsys) -> None:
    """Issue "the first hour": a job file whose data is still to be made checks out (its plan printed, exit 0, the
    missing file a WARNING naming the key and what to do); `lorarl run` refuses it before anything starts."""
    job = write_job(tmp_path / "job", reward="exact")  # not myreward: a module imported once stays in sys.modules
    assert main(["run", str(job), "--dry-run", "data.train_path=missing.parquet"]) == 0
    out = capsys.readouterr().out
    assert "WARNING data.train_path: no such file or folder: 'missing.parquet'" in out, out
    assert "hint: relative paths are looked up in the job file's folder" in out and "data.dataset (ORG/NAME)" in out
    assert "data test: datasets " in out and out.rstrip().endswith("config OK, with 1 WARNING above")
    assert main(["run", str(job), "data.train_path=missing.parquet", f"output.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "lorarl: bad config: data.train_path: no such file or folder: 'missing.parquet'" in err, err
    assert not (tmp_path / "run" / "services").exists()


def test_reward_forms_get_what_they_ask_for(tmp_path: Path) -> None:
    example = Example("2+2=", 4, {"question": "2+2=", "solution": 4, "level": 2, "source": "b"})
    seen: list[tuple] = []

    def sample(prompt, completion, level, answer):  # names two columns: gets those two only
        seen.append((prompt, completion, level, answer))
        return float(completion == "4")

    def pair(completion, answer):
        return float(completion == answer)

    async def batch(prompts, completions, **columns):
        assert prompts == ["2+2="] * 3 and columns["level"] == [2] * 3 and columns["source"] == ["b"] * 3
        return [float(c == "4") for c in completions]

    def short(prompts, completions, **columns):
        return [1.0]  # one score for three completions: every sample is a failure

    async def score(fn) -> tuple[list[float], int]:
        reward = Reward(fn)
        try:
            return await reward.score(example, ["4", "5", "4"])
        finally:
            reward.close()

    assert asyncio.run(score(sample)) == ([1.0, 0.0, 1.0], 0)
    assert seen[0] == ("2+2=", "4", 2, 4)
    assert asyncio.run(score(pair)) == ([1.0, 0.0, 1.0], 0)  # the answer as text, "4"
    assert asyncio.run(score(batch)) == ([1.0, 0.0, 1.0], 0)
    assert asyncio.run(score(short)) == ([0.0, 0.0, 0.0], 3)
    with pytest.raises(ConfigError, match="takes prompt but no completion"):
        Reward(lambda prompt: 1.0)
    with pytest.raises(RewardError, match="returned 1 for a batch of 3"):
        reward = Reward(short, on_error="fail")
        asyncio.run(reward.score(example, ["4", "5", "4"]))


def test_a_slow_synchronous_reward_runs_off_the_event_loop() -> None:
    """The reward blocks until a coroutine on the loop lets it go: on the loop's own thread, it never would."""
    released = threading.Event()
    threads: list[str] = []

    def slow(prompt, completion, **columns):
        threads.append(threading.current_thread().name)
        if not released.wait(timeout=10):
            raise TimeoutError("the event loop never ran while the reward waited")
        return 1.0

    async def scenario() -> tuple[list[float], int]:
        reward = Reward(slow, workers=2)

        async def release() -> None:
            await asyncio.sleep(0.05)
            released.set()

        scored, _ = await asyncio.gather(reward.score(Example("p", "a"), ["x", "y"]), release())
        reward.close()
        return scored

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=20)) == ([1.0, 1.0], 0)
    assert threads and all(name.startswith("reward") for name in threads)


def test_a_reward_and_a_workflow_load_from_the_job_folder(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job")
    cfg = load_job_config(str(job), ["workflow.name=single_turn"])
    assert load_reward("myreward:judge", cfg.job_dir).__name__ == "judge"
    assert type(job_workflow(cfg)).__name__ == "SingleTurn"


def test_prompts_render_by_their_type_with_the_system_prompt_and_thinking_switch(tmp_path: Path) -> None:
    plain = ChatRenderer(str(DENSE_MODEL_DIR))
    tok = plain.tokenizer
    chat = [{"role": "user", "content": "5+5="}]
    assert plain.prompt_ids(chat) == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)
    looks_like_json = '[{"role": "user", "content": "x"}]'
    assert tok.decode(plain.prompt_ids(looks_like_json)).count("<|im_start|>user\n[{") == 1
    system = ChatRenderer(str(DENSE_MODEL_DIR), system_prompt="Be brief.")
    assert tok.decode(system.prompt_ids("5+5=")).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert ChatRenderer(str(DENSE_MODEL_DIR), chat_template=False).prompt_ids("5+5=") == tok.encode("5+5=")
    # enable_thinking reaches the template (the tiny model's ignores it: a copy with one that reads it)
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        (model / name).write_bytes((DENSE_MODEL_DIR / name).read_bytes())
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] += "{%- if enable_thinking is defined and not enable_thinking %}NOTHINK{%- endif %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    off, default = ChatRenderer(str(model), enable_thinking=False), ChatRenderer(str(model))
    assert tok.decode(off.prompt_ids("q")).endswith("NOTHINK") and not tok.decode(default.prompt_ids("q")).endswith(
        "NOTHINK")


def test_a_batched_reward_may_return_any_sized_sequence_and_score_wants_a_list() -> None:
    import numpy as np

    async def run(fn, completions):
        reward = Reward(fn)
        try:
            return await reward.score(Example("p", "4"), completions)
        finally:
            reward.close()

    assert asyncio.run(run(lambda prompts, completions, **c: np.array([1.0, 0.0]), ["4", "5"])) == ([1.0, 0.0], 0)
    with pytest.raises(TypeError, match="a list of completions"):
        asyncio.run(run(lambda completion, answer: 1.0, "4"))


def test_a_followup_renders_under_a_template_that_changes_the_last_assistant_turn(tmp_path: Path) -> None:
    """Qwen3's thinking template writes an empty think block into the last assistant turn only, so a shorter
    rendering is no prefix of a longer one; what follows the head's end of turn is still the followup."""
    model = tmp_path / "thinking"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        (model / name).write_bytes((DENSE_MODEL_DIR / name).read_bytes())
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        "{{- m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    renderer = ChatRenderer(str(model))
    followup = renderer.decode(renderer.render_followup([{"role": "user", "content": "again"}]))
    assert renderer.tokenizer.decode(renderer.render_followup([{"role": "user", "content": "again"}])) == \
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n" and "again" in followup


def test_same_turn_samples_of_one_prompt_are_not_merged_into_one_seed() -> None:
    from lorarl.client.workflow.coalesce import CoalescingRollout
    from lorarl.v1 import common_pb2, rollout_pb2

    sent: list[list[tuple[int, ...]]] = []

    class Rollout:
        async def Generate(self, request):  # noqa: N802
            sent.append([tuple(p.token_ids) for p in request.prompts])
            return rollout_pb2.GenerateResponse(results=[rollout_pb2.PromptCompletions() for _ in request.prompts])

    async def scenario() -> None:
        sampler = CoalescingRollout(Rollout())

        def request(ids: list[int]) -> rollout_pb2.GenerateRequest:
            return rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=ids)],
                                               sampling=common_pb2.SamplingParams(n=1, seed=len(sent)))

        await asyncio.gather(*(sampler.Generate(request(ids), group="b0") for ids in ([1, 2], [1, 2], [3], [1, 2])))

    asyncio.run(scenario())
    assert sorted(map(sorted, sent)) == [[(1, 2)], [(1, 2)], [(1, 2), (3,)]]  # one of each prompt per request


def test_the_dry_run_reads_every_row_and_measures_every_prompt(tmp_path: Path, capsys) -> None:
    """Issue "the first hour": a bad row 7 passed because 3 rows were read, and data.max_prompt_tokens was never
    measured. Every row is read (the plan counts them), every prompt rendered as the loop renders it: a row
    without the prompt column, or a prompt longer than data.max_prompt_tokens, fails the dry run naming the key."""
    job = write_job(tmp_path / "job")
    assert main(["run", str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "data train: datasets" in out and "3 rows" in out and "data.max_prompt_tokens 256" in out, out
    rows = [{"question": f"{i}+{i}=", "solution": 2 * i, "level": 1, "source": "x"} for i in range(9)]
    rows[7] = {"solution": 14, "level": 1, "source": "x"}
    (tmp_path / "job" / "long.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["run", str(job), "--dry-run", "data.train_path=long.jsonl"]) == 2
    out = capsys.readouterr().out
    assert "lorarl: bad config: data.train_path: row 8 of" in out and "config OK" not in out, out
    assert main(["run", str(job), "--dry-run", "data.max_prompt_tokens=5"]) == 2
    out = capsys.readouterr().out
    assert "lorarl: bad config: data.max_prompt_tokens: is 5, but 3 train prompt(s) render longer" in out, out


def test_a_relative_model_path_is_found_from_the_job_folder_the_current_folder_or_lorarls_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Issue "the first hour": `lorarl run /abs/path/examples/demo.yaml` from another folder failed on model.path.
    A relative model.path is looked up in the job file's folder first, then the current folder, then where lorarl
    is installed (the shipped models); it is kept as written where none holds it (a hub name)."""
    monkeypatch.chdir(tmp_path)
    demo = load_job_config(str(ROOT / "examples/demo.yaml"), [])
    assert demo.model.path == str(DENSE_MODEL_DIR.resolve())
    assert main(["run", str(ROOT / "examples/demo.yaml"), "--dry-run"]) == 0 and "config OK" in capsys.readouterr().out
    job = write_job(tmp_path / "job")
    (tmp_path / "job" / "mymodel").mkdir()
    mine = load_job_config(str(job), ["model.path=mymodel"])
    assert mine.model.path == str((tmp_path / "job" / "mymodel").resolve())
    assert load_job_config(str(job), ["model.path=Qwen/Qwen3-8B"]).model.path == "Qwen/Qwen3-8B"


def test_a_hub_model_id_resolves_through_the_hugging_face_cache_offline(tmp_path: Path) -> None:
    """Issue "the first hour": `model.path: Qwen/Qwen3-0.6B` as TRL and verl take it. A cache this test builds
    (huggingface_hub's layout: models--ORG--NAME/snapshots/REV, refs/main), HF_HUB_CACHE pointing at it and
    HF_HUB_OFFLINE=1: the dry run resolves the id to the snapshot and passes, and `lorarl run` of an id that is not
    cached stops before anything starts, naming model.path and the offline switch."""
    import shutil

    cache = tmp_path / "hub"
    revision = "0" * 40
    snapshot = cache / "models--lorarl-test--qwen3-tiny" / "snapshots" / revision
    shutil.copytree(DENSE_MODEL_DIR, snapshot)
    (cache / "models--lorarl-test--qwen3-tiny" / "refs").mkdir()
    (cache / "models--lorarl-test--qwen3-tiny" / "refs" / "main").write_text(revision)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, "HF_HUB_CACHE": str(cache),
           "HF_HUB_OFFLINE": "1"}
    run = [sys.executable, "-m", "lorarl.client.cli", "run", str(ROOT / "examples/demo.yaml")]
    done = subprocess.run([*run, "model.path=lorarl-test/qwen3-tiny", "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"model {snapshot}" in done.stdout and done.stdout.rstrip().endswith("config OK"), done.stdout
    missing = subprocess.run([*run, "model.path=lorarl-test/not-cached", f"output.dir={tmp_path / 'run'}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "model.path: 'lorarl-test/not-cached' is a Hugging Face Hub model that is not in the cache" in \
        missing.stderr and "HF_HUB_OFFLINE" in missing.stderr, missing.stderr
    assert not (tmp_path / "run" / "services").exists()
