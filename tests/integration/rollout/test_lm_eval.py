"""lm-evaluation-harness against the rollout's OpenAI-compatible endpoint, as its users run it: the
``local-completions`` model (token-id prompts, concurrent requests) on two tasks with local data made from the
shipped arithmetic test set, one generation task (greedy, exact match) and one multiple-choice task
(log-likelihood of each choice: ``echo`` with prompt logprobs). Each scores what lm-eval's own ``hf`` model
scores on the same model directory, and every choice's log-likelihood and greedy flag agree."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorarl.contract.chat import ChatRenderer
from lorarl.rollout.openai.http_server import OpenAIServer
from tests.integration.rollout.harness import TOKEN, RolloutHarness, openai_served

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "lorarl" / "assets" / "models" / "qwen3-tiny"
DOCS = 60  # of the shipped test set's additions: 60 generations, 240 log-likelihoods per model

#: What both tasks read: the local data file, its prompts as they are.
DATA = """dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
doc_to_text: "{{{{prompt}}}}"
"""
GENERATE = """task: lorarl_add_generate
output_type: generate_until
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["<|im_end|>"], max_gen_toks: 8, do_sample: false, temperature: 0}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
"""
CHOOSE = """task: lorarl_add_choice
output_type: multiple_choice
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
"""


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[RolloutHarness, OpenAIServer]]:
    with openai_served(MODEL) as served:
        yield served


def task_dir(tmp: Path) -> Path:
    """The two tasks' YAML and data: additions from the shipped test set in the demo's chat format, with three
    wrong sums as choices."""
    renderer = ChatRenderer(str(MODEL))
    docs = []
    for line in (ROOT / "lorarl/assets/data/tasks/test.jsonl").read_text().splitlines():
        doc = json.loads(line)
        if doc["task"] == "add" and len(docs) < DOCS:
            right = int(doc["answer"])
            choices = [str(right), str(right + 1), str(right - 10), str(right)[::-1] + "0"]
            label = len(docs) % 4  # the right answer at each place in turn
            choices[0], choices[label] = choices[label], choices[0]
            chat = renderer.render([{"role": "user", "content": doc["prompt"]}])
            docs.append({"prompt": renderer.tokenizer.decode(chat, skip_special_tokens=False), "answer": doc["answer"],
                         "choices": choices, "label": label})
    data = tmp / "add.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp / "generate.yaml").write_text((GENERATE + DATA).format(data=data))
    (tmp / "choose.yaml").write_text((CHOOSE + DATA).format(data=data))
    return tmp


def evaluate(model: str, model_args: dict[str, Any], tasks: Path) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args,
                                   tasks=["lorarl_add_generate", "lorarl_add_choice"],
                                   task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def per_doc(results: dict[str, Any], task: str) -> list[Any]:
    return [s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_scores_on_the_endpoint_what_it_scores_on_the_hf_model(served, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, server = served
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    tasks = task_dir(tmp_path)
    endpoint = evaluate("local-completions", {
        "model": "base", "base_url": f"http://127.0.0.1:{server.port}/v1/completions", "tokenizer": str(MODEL),
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 4, "max_retries": 1,
        "header": {"Authorization": f"Bearer {TOKEN}"}}, tasks)
    hf = evaluate("hf", {"pretrained": str(MODEL), "dtype": "float32", "device": "cpu"}, tasks)

    for task, metrics in (("lorarl_add_generate", ["exact_match,none"]),
                          ("lorarl_add_choice", ["acc,none", "acc_norm,none"])):
        for metric in metrics:
            print(f"{task} {metric}: endpoint {endpoint['results'][task][metric]:.3f}, "
                  f"hf {hf['results'][task][metric]:.3f}")
            assert endpoint["results"][task][metric] == hf["results"][task][metric], (task, metric)
    assert per_doc(endpoint, "lorarl_add_generate") == per_doc(hf, "lorarl_add_generate")
    # both tasks mean something here: the model gets some sums right and some wrong
    assert 0 < endpoint["results"]["lorarl_add_generate"]["exact_match,none"] < 1
    assert 0.25 < endpoint["results"]["lorarl_add_choice"]["acc,none"] <= 1
    choices_endpoint, choices_hf = per_doc(endpoint, "lorarl_add_choice"), per_doc(hf, "lorarl_add_choice")
    assert len(choices_endpoint) == DOCS
    for ours, theirs in zip(choices_endpoint, choices_hf, strict=True):
        assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in theirs], abs=1e-3)
        assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
