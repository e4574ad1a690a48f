"""The shipped task splits, rewards and tokenizer: fixed, disjoint, correct on hand-made cases."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from lorarl.assets import TASKS_DIR, TOKENIZER_DIR, load_split, reward_fn
from lorarl.assets.tasks import (
    REWARD_FNS,
    TEST_PER_TASK,
    Problem,
    build_splits,
    extract_answer,
    task_kind,
    write_splits,
)
from lorarl.assets.tokenizer import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    load_tokenizer,
    prompt_token_ids,
    render_prompt,
)

EXPECTED_TEST_SHA256 = "5a90c3994cbf75d39e31f21c4a028fb2293eb1be0d29894adbbc05df676de02a"
"""sha256 of the shipped test split: a deliberate change updates it, an accidental one fails."""

# ------------------------------------------------------------------------------------------------ splits


@pytest.fixture(scope="module")
def train() -> list[Problem]:
    return load_split("train")


@pytest.fixture(scope="module")
def test() -> list[Problem]:
    return load_split("test")


def test_shipped_splits_are_what_the_seeded_builder_makes(tmp_path):
    paths = write_splits(tmp_path)
    for split, path in paths.items():
        assert path.read_bytes() == (TASKS_DIR / f"{split}.jsonl").read_bytes(), split


def test_splits_are_deterministic():
    first, second = build_splits(), build_splits()
    assert first == second
    assert build_splits(seed=1)["test"] != first["test"]


def test_splits_are_disjoint_and_duplicate_free(train, test):
    train_prompts = [p.prompt for p in train]
    test_prompts = [p.prompt for p in test]
    assert len(set(train_prompts)) == len(train_prompts)
    assert len(set(test_prompts)) == len(test_prompts)
    assert not set(train_prompts) & set(test_prompts)


def test_split_sizes_and_task_mix(train, test):
    assert 200 <= len(test) <= 500
    assert len(train) >= 10 * len(test)
    assert {p.task for p in test} == {"add", "sort"}
    assert sum(p.task == "add" for p in test) == TEST_PER_TASK


def test_split_rows_have_the_documented_fields():
    first = json.loads((TASKS_DIR / "test.jsonl").read_text().splitlines()[0])
    assert set(first) == {"prompt", "answer", "task"}


def test_gold_answers_are_right(train, test):
    for problem in train + test:
        if problem.task == "add":
            a, b = problem.prompt.removesuffix("=").split("+")
            assert problem.answer == str(int(a) + int(b)), problem
        else:
            digits = problem.prompt.removeprefix("sort ")
            assert len(digits) == 5 and problem.answer == "".join(sorted(digits)), problem


def test_test_split_is_pinned():
    """Results across the project are comparable only while the held-out set stays the same."""
    digest = hashlib.sha256((TASKS_DIR / "test.jsonl").read_bytes()).hexdigest()
    assert digest == EXPECTED_TEST_SHA256, "test split changed: update this pin deliberately"


def test_load_split_rejects_unknown_split():
    with pytest.raises(ValueError, match="split"):
        load_split("validation")


# ------------------------------------------------------------------------------------------------ slips


@pytest.mark.parametrize(
    ("task", "prompt", "gold", "slip"),
    [
        ("add", "57+68=", "125", "15"),
        ("add", "12+34=", "46", "46"),  # no carry: the slip is harmless
        ("add", "19+11=", "30", "20"),
        ("add", "50+50=", "100", "0"),
        ("sort", "sort 30931", "01339", "0139"),
        ("sort", "sort 52413", "12345", "12345"),  # distinct digits: harmless
        ("sort", "sort 77777", "77777", "7"),
    ],
)
def test_gold_and_slip(task, prompt, gold, slip):
    kind = task_kind(task)
    assert kind.solve(prompt) == gold
    assert kind.slip(prompt) == slip


def test_slip_is_harmless_on_about_a_quarter_of_test_problems(test):
    harmless = sum(task_kind(p.task).slip(p.prompt) == p.answer for p in test) / len(test)
    assert 0.2 <= harmless <= 0.35


def test_unknown_task_is_named():
    with pytest.raises(KeyError, match="known"):
        task_kind("multiply")


# ---------------------------------------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("125", "125"),
        (" 125\n", "125"),
        ("125<|im_end|>", "125"),
        ("125<|im_end|>\n<|im_start|>user", "125"),
        ("125<|endoftext|>", "125"),
        ("01339", "01339"),
        ("", None),
        ("12 5", None),
        ("125 apples", None),
        ("answer: 125", None),
        ("-5", None),
        ("<|im_end|>", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_exact_reward():
    exact = reward_fn("exact")
    assert exact("125", "125") == 1.0
    assert exact("125<|im_end|>", "125") == 1.0
    assert exact("124", "125") == 0.0
    assert exact("0125", "125") == 0.0
    assert exact("1250", "125") == 0.0
    assert exact("", "125") == 0.0
    assert exact("0139", "01339") == 0.0


def test_exact_format_reward_gives_a_small_bonus_for_well_formed_wrong_answers():
    shaped = reward_fn("exact_format")
    assert shaped("125", "125") == 1.0
    assert 0.0 < shaped("124", "125") < 0.5
    assert shaped("12 4", "125") == 0.0


def test_reward_registry():
    assert reward_fn() is reward_fn("exact")
    assert {"exact", "exact_format", "format"} <= set(REWARD_FNS)
    assert reward_fn("format")("999", "1") == 1.0
    with pytest.raises(KeyError, match="known"):
        reward_fn("bleu")


# -------------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER_DIR)


def test_tokenizer_special_ids(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == PAD_TOKEN_ID
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 257


@pytest.mark.parametrize("text", ["57+68=", "sort 30931", "héllo wörld ✓\n\ttabs", "user said: assistant"])
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_bytes_are_their_own_ids(tokenizer):
    assert tokenizer.encode("09+ ", add_special_tokens=False) == [ord(c) for c in "09+ "]


def test_chat_template_renders_chatml(tokenizer):
    text = render_prompt(tokenizer, "57+68=")
    assert text == "<|im_start|>user\n57+68=<|im_end|>\n<|im_start|>assistant\n"
    ids = prompt_token_ids(tokenizer, "57+68=")
    assert ids[0] == 257 and ids[-1] == ord("\n") and ids.count(EOS_TOKEN_ID) == 1
    assert len(ids) == 14  # role names are single tokens
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_multi_turn_without_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
    )


def test_chat_template_is_stored_in_tokenizer_config():
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert not (TOKENIZER_DIR / "chat_template.jinja").exists()


# ---------------------------------------------------------------------------------------------- helpers


def test_importing_assets_stays_cheap():
    """Services import the paths and task helpers; that must not drag in torch or transformers."""
    code = "import sys, lorarl.assets; assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_render_prompt_is_exported_lazily(tokenizer):
    import lorarl.assets

    assert lorarl.assets.render_prompt(tokenizer, "1+1=").endswith("<|im_start|>assistant\n")


def test_evaluate_greedy_scores_a_generate_callable(test):
    from lorarl.assets.evaluate import evaluate_greedy

    gold = {p.prompt: p.answer for p in test}
    oracle = evaluate_greedy(lambda prompts: [gold[p] + "<|im_end|>" for p in prompts], test)
    assert oracle.accuracy == 1.0 and oracle.per_task == {"add": 1.0, "sort": 1.0}

    def slipping(prompts):
        return [task_kind("sort" if p.startswith("sort") else "add").slip(p) for p in prompts]

    slipped = evaluate_greedy(slipping, "test", limit=100)
    harmless = sum(task_kind(p.task).slip(p.prompt) == p.answer for p in test[:100]) / 100
    assert slipped.accuracy == pytest.approx(harmless)
    assert len(slipped.completions) == 100
