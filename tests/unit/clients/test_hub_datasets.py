"""Issue "the first hour", items 2 and 3 (data): a Hugging Face Hub dataset as users write it (``data.dataset:
openai/gsm8k``, ``data.config: main``, its splits by data.train_split / test_split), read from the datasets cache
(HF_HOME / HF_DATASETS_CACHE) and never downloaded by a dry run; `lorarl run` downloads one that is missing
before anything starts, and refuses offline naming the key; `lorarl data gsm8k OUT` writes the JSONL files the
example jobs read.

There is no network here: the cache is built by the test (tests/support/hub_cache.py) in a temporary HF_HOME
with HF_HUB_OFFLINE=1. datasets and huggingface_hub read those variables once, when imported, so the fixture sets
the values they set as well as the variables (the library's own attributes, nothing of lorarl's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorarl.client.cli import main
from lorarl.client.commands.run import data_ready
from lorarl.client.job.config import load_job_config
from lorarl.client.job.inputs import job_examples
from lorarl.client.job.rewards import gsm8k_reward
from lorarl.common.config import ConfigError
from tests.support.hub_cache import cache_hub_dataset

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "examples/demo.yaml"


def gsm8k_rows(n: int, **extra: object) -> list[dict[str, object]]:
    return [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}", **extra}
            for i in range(n)]


def hub_job(repo_id: str, *more: str) -> list[str]:
    """Overrides of the demo job that read GSM8K from Hub dataset ``repo_id``."""
    return ["data.source=gsm8k", f"data.dataset={repo_id}", "data.reward=gsm8k", "data.max_prompt_tokens=64", *more]


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty datasets cache in a temporary HF_HOME, with HF_HUB_OFFLINE=1."""
    import datasets.config
    import huggingface_hub.constants

    cache = tmp_path / "hf" / "datasets"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE unset, as the libraries see it."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_a_hub_datasets_splits_of_one_config_are_read_from_the_cache_offline(hub_cache: Path, capsys) -> None:
    cache_hub_dataset(hub_cache, "lorarl-test/tiny_gsm8k", "main", {"train": gsm8k_rows(3), "test": gsm8k_rows(2)})
    assert main(["run", str(DEMO), *hub_job("lorarl-test/tiny_gsm8k", "data.config=main"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "data train: gsm8k 'lorarl-test/tiny_gsm8k' (config 'main') split 'train', 3 rows" in out, out
    assert "data test: gsm8k 'lorarl-test/tiny_gsm8k' (config 'main') split 'test', 2 rows" in out, out
    assert out.rstrip().endswith("config OK") and "WARNING" not in out
    cfg = load_job_config(str(DEMO), hub_job("lorarl-test/tiny_gsm8k", "data.config=main"))
    assert [e.answer for e in job_examples(cfg, "train")] == ["0", "2", "4"]  # the gsm8k path: the gold number
    # a second configuration in the cache: data.config picks one, and without it the choice is the user's
    cache_hub_dataset(hub_cache, "lorarl-test/tiny_gsm8k", "socratic", {"train": gsm8k_rows(5), "test": gsm8k_rows(4)})
    assert main(["run", str(DEMO), *hub_job("lorarl-test/tiny_gsm8k", "data.config=socratic"), "--dry-run"]) == 0
    assert "split 'train', 5 rows" in capsys.readouterr().out
    assert main(["run", str(DEMO), *hub_job("lorarl-test/tiny_gsm8k"), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "lorarl: bad config: data.config: data.dataset 'lorarl-test/tiny_gsm8k' has several configurations" in out
    assert main(["run", str(DEMO), *hub_job("lorarl-test/tiny_gsm8k", "data.config=main", "data.test_split=dev"),
                 "--dry-run"]) == 2
    assert "data.test_split: 'lorarl-test/tiny_gsm8k' has no split 'dev'; its splits: ['test', 'train']" in \
        capsys.readouterr().out


def test_a_hub_dataset_not_in_the_cache_is_a_warning_of_the_plan_and_refused_offline_by_run(
        hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import datasets

    job = [str(DEMO), *hub_job("lorarl-test/absent", "data.config=main")]
    assert main(["run", *job, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"WARNING data.dataset: 'lorarl-test/absent' (config 'main') is not in the datasets cache ({hub_cache})" \
           in out and "HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set" in out, out
    assert out.count("\nWARNING") == 1 and out.rstrip().endswith("config OK, with 1 WARNING above")
    assert main(["run", *job, f"output.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "lorarl: bad config: data.dataset: 'lorarl-test/absent' (config 'main') is a Hugging Face Hub dataset " \
           "that is not in the datasets cache" in err and "HF_HUB_OFFLINE" in err, err
    assert not (tmp_path / "run" / "services").exists()
    # online, the dry run still reads the cache alone: it says `lorarl run` downloads, and downloads nothing
    online(monkeypatch)

    def no_download(*args, **kwargs):
        raise AssertionError("a dry run downloaded")

    monkeypatch.setattr(datasets.DatasetBuilder, "download_and_prepare", no_download)
    assert main(["run", *job, "--dry-run"]) == 0
    assert "hint: `lorarl run` downloads it before anything starts" in capsys.readouterr().out


def test_lorarl_run_downloads_a_missing_hub_dataset_before_anything_starts(
        hub_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The Hub stands in at datasets' own entry point: a builder whose download prepares the cache entry."""
    import datasets

    online(monkeypatch)
    real, fetched = datasets.load_dataset_builder, []

    class Download:
        def __init__(self, repo_id: str, config: str) -> None:
            self.repo_id, self.config = repo_id, config

        def download_and_prepare(self) -> None:
            fetched.append((self.repo_id, self.config))
            cache_hub_dataset(hub_cache, self.repo_id, self.config, {"train": gsm8k_rows(3), "test": gsm8k_rows(2)})

    def hub(repo_id: str, config: str | None = None, **kwargs):
        return real(repo_id, config, **kwargs) if datasets.config.HF_HUB_OFFLINE else Download(repo_id, config)

    monkeypatch.setattr(datasets, "load_dataset_builder", hub)
    cfg = load_job_config(str(DEMO), hub_job("lorarl-test/fetched", "data.config=main"))
    assert data_ready(cfg) and fetched == [("lorarl-test/fetched", "main")]
    assert f"lorarl: downloading 'lorarl-test/fetched' (config 'main') into the datasets cache ({hub_cache})" in \
        capsys.readouterr().out
    assert len(job_examples(cfg, "train")) == 3 and len(job_examples(cfg, "test")) == 2
    assert data_ready(cfg) and len(fetched) == 1  # cached now


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["data.config=main"], "data.config", "names a configuration of data.dataset"),
    (["data.source=jsonl", "data.dataset=openai/gsm8k"], "data.dataset", "is read with data.source datasets"),
    (["data.source=datasets", "data.dataset=./my_data"], "data.dataset", "expected a Hugging Face Hub dataset id"),
    (["data.source=gsm8k", "data.dataset=openai/gsm8k", "data.train_path=x.jsonl"], "data.dataset",
     "names both splits"),
    (["data.source=hf"], "data.source", "a Hugging Face Hub dataset is data.dataset: ORG/NAME"),
    (["data.source=gsm8k"], "data.train_path", "or data.dataset"),
])
def test_the_hub_keys_are_checked_when_the_job_file_loads(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: .*{words}"):
        load_job_config(str(DEMO), overrides)


def test_the_gsm8k_reward_takes_the_gold_number_of_a_whole_solution() -> None:
    """GSM8K read with data.source=datasets keeps the solution as the answer: the gsm8k reward still scores it."""
    assert gsm8k_reward("so it is 1,024", "512 * 2 = 1,024\n#### 1024") == 1.0
    assert gsm8k_reward("so it is 1024", "1024") == 1.0 and gsm8k_reward("so it is 7", "#### 8") == 0.0


def test_lorarl_data_gsm8k_writes_the_files_the_example_jobs_read(hub_cache: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    cache_hub_dataset(hub_cache, "openai/gsm8k", "main", {"train": gsm8k_rows(3, level=1),
                                                          "test": gsm8k_rows(2, level=2)})
    monkeypatch.chdir(tmp_path)
    assert main(["data", "gsm8k", "data/gsm8k"]) == 0
    assert capsys.readouterr().out.splitlines() == ["wrote 3 rows to data/gsm8k/train.jsonl",
                                                    "wrote 2 rows to data/gsm8k/test.jsonl"]
    rows = [json.loads(line) for line in Path("data/gsm8k/test.jsonl").read_text().splitlines()]
    assert rows == [{"question": "What is 0 + 0?", "answer": "0 + 0 = 0\n#### 0"},
                    {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}]  # GSM8K's two columns only
    assert sorted(p.name for p in Path("data/gsm8k").iterdir()) == ["test.jsonl", "train.jsonl"]
    assert main(["run", str(ROOT / "examples/models/qwen3-0.6b.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "data train: gsm8k data/gsm8k/train.jsonl, 3 rows" in out and "WARNING" not in out, out
    assert main(["data", "gsm8k", "elsewhere", "--dataset", "lorarl-test/absent"]) == 2
    err = capsys.readouterr().err
    assert "lorarl data: --dataset: 'lorarl-test/absent' (config 'main') is a Hugging Face Hub dataset that is not " \
           "in the datasets cache" in err and "HF_HUB_OFFLINE" in err, err
    assert not Path("elsewhere").exists()
    assert main(["data", "gsm8k", "data/gsm8k/train.jsonl"]) == 2
    assert "OUT: 'data/gsm8k/train.jsonl' is a file" in capsys.readouterr().err
