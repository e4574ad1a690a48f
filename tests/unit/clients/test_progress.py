"""The progress display: what it shows, and how it draws on a terminal vs into a log file."""

from __future__ import annotations

import io

import pytest

from lorarl.client.rl.progress import ProgressBar, bar, format_duration
from lorarl.client.rl.run_log import RunLog


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def step_row(step: int, **extra: float) -> dict[str, float]:
    return {"step": float(step), "rollout/reward_mean": 0.5, "rollout/accuracy": 0.25, "train/version": float(step),
            "policy/version_lag": 1.0, "rollout/tokens_per_s": 1234.0, "time_s": 10.0 * step, **extra}


def test_bar_and_durations() -> None:
    assert bar(0, 10, width=10) == "[..........]"
    assert bar(5, 10, width=10) == "[#####.....]"
    assert bar(12, 10, width=10) == "[##########]"
    assert format_duration(42) == "42s"
    assert format_duration(125) == "2m05s"
    assert format_duration(3 * 3600 + 61) == "3h01m"


def test_step_line_shows_what_a_user_watches() -> None:
    clock = FakeClock()
    progress = ProgressBar(40, stream=io.StringIO(), clock=clock)
    clock.now += 4.0
    progress.update(step_row(2))  # first step seen: counts from step 1, 4 s ago
    clock.now += 4.0
    progress.update(step_row(3))
    line = progress.stream.getvalue().splitlines()[-1]
    assert "3/40" in line and "reward 0.500" in line and "acc 0.250" in line
    assert "v3 lag 1" in line and "1234 tok/s" in line
    assert "0.25 step/s" in line  # 2 steps in 8 s
    assert "ETA 2m28s" in line  # 37 steps left at 0.25 step/s


def test_log_file_gets_one_line_per_step_and_eval() -> None:
    out = io.StringIO()
    progress = ProgressBar(4, stream=out)
    progress.update(step_row(1))
    progress.update({"step": 1.0, "eval/accuracy": 0.75, "eval/mean_reward": 0.8, "time_s": 12.0})
    progress.update(step_row(2))
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    assert lines[1].startswith("[eval] step 1/4  held-out accuracy 0.750")


def test_terminal_redraws_one_line_and_keeps_evals() -> None:
    term = Terminal()
    progress = ProgressBar(4, stream=term)
    progress.update(step_row(1))
    progress.update(step_row(2))
    progress.update({"step": 2.0, "eval/accuracy": 0.5, "eval/mean_reward": 0.5, "time_s": 20.0})
    progress.update(step_row(3))
    progress.close()
    text = term.getvalue()
    assert text.count("\r") == 3  # every step redraws in place
    lines = text.split("\n")
    # The bar (last drawn at step 2) is finished with a newline before the eval line, which stays.
    assert lines[0].rsplit("\r", 1)[-1].strip().startswith("[############............] 2/4")
    assert lines[1].startswith("[eval] step 2/4")
    assert "3/4" in lines[2] and lines[3] == ""


def test_run_log_writes_jsonl_and_summary(tmp_path) -> None:
    log = RunLog(tmp_path, total_steps=2, tensorboard=False, progress=False)
    log({"step": 0.0, "eval/accuracy": 0.25, "eval/mean_reward": 0.3, "time_s": 0.0})
    log(step_row(1))
    log(step_row(2, **{"policy/version_lag": 2.0}))
    log({"step": 2.0, "eval/accuracy": 0.75, "eval/mean_reward": 0.8, "time_s": 20.0})
    log.close()
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4
    summary = log.summary()
    assert "0.250 -> 0.750 (+50.0 points)" in summary
    assert "steps: 2" in summary and "max policy version lag: 2" in summary
    assert log.plot().stat().st_size > 1000


def test_step_line_shows_the_rollout_vs_trainer_kl_and_its_alarm() -> None:
    progress = ProgressBar(40, stream=io.StringIO(), clock=FakeClock())
    progress.update(step_row(1, **{"train/rollout_kl_k3": 0.00123}))
    progress.update(step_row(2, **{"train/rollout_kl_k3": 0.05, "policy/mismatch_alarm": 1.0}))
    first, second = progress.stream.getvalue().splitlines()[-2:]
    assert "mismatch 1.2e-03" in first and "(!)" not in first and "kl_ref" not in first
    assert "mismatch 5.0e-02 (!)" in second


def test_step_line_names_the_kl_to_the_reference_apart_from_the_mismatch_and_shows_the_length() -> None:
    progress = ProgressBar(40, stream=io.StringIO(), clock=FakeClock())
    progress.update(step_row(1, **{"train/kl_ref": 0.004, "train/rollout_kl_k3": 0.0001,
                                   "rollout/response_length_mean": 41.6}))
    line = progress.stream.getvalue().splitlines()[-1]
    assert "kl_ref 4.0e-03" in line and "mismatch 1.0e-04" in line and "len 42" in line


def test_rollout_stats_are_what_rl_users_read() -> None:
    """Response lengths, the share cut at max_tokens, the reward's spread and the share of groups whose samples
    all scored the same (zero advantages: nothing to learn), from one step's samples."""
    from lorarl.client.rl.loop import Batch, rollout_stats

    batch = Batch(0, [], [1.0, 1.0, 0.0, 1.0, 0.5, 0.5], 0.5, 1.0, 12, 0, lengths=[2, 4, 6, 8, 1, 3], truncated=2,
                  groups=[[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    stats = rollout_stats(batch)
    assert stats["rollout/response_length_mean"] == 4.0 and stats["rollout/response_length_max"] == 8.0
    assert stats["rollout/truncated_fraction"] == 2 / 6
    assert stats["rollout/zero_advantage_groups"] == 2 / 3
    mean = 4.0 / 6
    assert stats["rollout/reward_std"] == pytest.approx((sum((r - mean) ** 2 for r in batch.rewards) / 6) ** 0.5)


def test_a_steps_samples_go_to_samples_jsonl(tmp_path) -> None:
    import json

    from lorarl.client.rl.run_log import RunLog

    log = RunLog(tmp_path, total_steps=2, tensorboard=True, progress=False)
    log.samples(1, [{"prompt": "sort 3 1", "completion": "1 3", "reward": 1.0, "answer": "1 3", "truncated": False}])
    log.close()
    (row,) = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert row == {"step": 1, "prompt": "sort 3 1", "completion": "1 3", "reward": 1.0, "answer": "1 3",
                   "truncated": False}
    assert any((tmp_path / "tensorboard").iterdir())


class WandbRecorder:
    """Stands for the wandb package at RunLog's seam (``wandb_module``): records what a run hands W&B, with no
    account and no package installed."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = False

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, metrics))

    def finish(self) -> None:
        self.finished = True


def test_the_wandb_run_takes_project_name_entity_and_tags_from_the_job_file(tmp_path) -> None:
    from lorarl.client.job.config import load_job_config
    from lorarl.client.rl.run_log import wandb_init

    cfg = load_job_config("examples/demo.yaml", ["output.wandb=true", "output.wandb_project=rl-sweeps",
                                                 "output.wandb_entity=my-team", "output.wandb_tags=[lora, grpo]"])
    recorder = WandbRecorder()
    log = RunLog(tmp_path, total_steps=1, tensorboard=False, progress=False, config={"job_id": cfg.job_id},
                 wandb=cfg.output.wandb, wandb_settings=wandb_init(cfg), wandb_module=recorder)
    log(step_row(1))
    log.close()
    assert recorder.inits == [{"project": "rl-sweeps", "name": cfg.job_id, "entity": "my-team",
                               "tags": ["lora", "grpo"], "config": {"job_id": cfg.job_id}, "dir": str(tmp_path)}]
    assert recorder.logged[0][0] == 1 and recorder.logged[0][1]["rollout/accuracy"] == 0.25 and recorder.finished
    # by default: project lorarl, the run named for the job, W&B's own entity; a name of its own when given
    default = load_job_config("examples/demo.yaml", [])
    assert wandb_init(default) == {"project": "lorarl", "name": default.job_id}
    named = load_job_config("examples/demo.yaml", ["output.wandb_run=try 3: lr 1e-4"])
    assert wandb_init(named)["name"] == "try 3: lr 1e-4"


@pytest.mark.parametrize(("override", "problem"), [
    ("output.wandb_project=", "expected a name"),
    ("output.wandb_project=team/rl", "no '/'"),
    ("output.wandb_entity=a#b", "no '#'"),
    ("output.wandb_tags=[ok, '']", "expected a name"),
    (f"output.wandb_tags=[{'x' * 65}]", "at most 64 characters"),
])
def test_wandb_names_wandb_would_refuse_are_refused_when_the_job_loads(override: str, problem: str) -> None:
    from lorarl.client.job.config import load_job_config
    from lorarl.common.config import ConfigError

    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError, match=rf"^{key}: .*{problem}"):
        load_job_config("examples/demo.yaml", [override])


def test_accuracy_counts_rewards_at_or_above_loop_success_reward_and_says_so() -> None:
    """The rule behind rollout/accuracy and eval/accuracy is the job's (loop.success_reward, 1 by default), and the
    evaluation line, the plot and the summary name it."""
    from lorarl.client.job.config import load_job_config
    from lorarl.client.rl.metric_names import successes

    assert load_job_config("examples/demo.yaml", []).loop.success_reward == 1.0
    assert load_job_config("examples/demo.yaml", ["loop.success_reward=0.5"]).loop.success_reward == 0.5
    assert successes([1.0, 0.5, 0.2, 1.5], 1.0) == 0.5 and successes([1.0, 0.5, 0.2, 1.5], 0.5) == 0.75
    assert successes([], 1.0) == 0.0
    progress = ProgressBar(4, stream=io.StringIO(), success_reward=0.5)
    progress.update({"step": 1.0, "eval/accuracy": 0.75, "eval/mean_reward": 0.8, "time_s": 12.0})
    assert "held-out accuracy 0.750 (reward >= 0.5)" in progress.stream.getvalue()


def test_the_summary_names_the_success_rule(tmp_path) -> None:
    log = RunLog(tmp_path, total_steps=1, tensorboard=False, progress=False, success_reward=0.5)
    log({"step": 0.0, "eval/accuracy": 0.25, "eval/mean_reward": 0.3, "time_s": 0.0})
    log({"step": 1.0, "eval/accuracy": 0.5, "eval/mean_reward": 0.6, "time_s": 1.0})
    log.close()
    summary = log.summary()
    assert "held-out greedy accuracy: 0.250 -> 0.500 (+25.0 points), counting reward >= 0.5 as a success" in summary


def test_loop_names_the_trainers_kl_for_what_it_is() -> None:
    """The trainer says "kl"; a run's log says train/kl_ref (KL to the reference), apart from the rollout-vs-trainer
    mismatch (train/rollout_kl_k3)."""
    from lorarl.client.rl.metric_names import train_metrics

    assert train_metrics({"kl": 0.01, "entropy": 1.5, "rollout_kl_k3": 0.001}) == {
        "train/kl_ref": 0.01, "train/entropy": 1.5, "train/rollout_kl_k3": 0.001}
