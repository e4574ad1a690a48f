"""lorarl.contract.tokenizer: the lean tokenizer gives transformers' AutoTokenizer's ids and text on every shipped
model (so a fresh `lorarl run` renders what it rendered with transformers), and anything it does not reproduce
goes to AutoTokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from lorarl.contract.tokenizer import LeanTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted(p for p in (ROOT / "lorarl/assets/models").iterdir() if (p / "tokenizer.json").is_file())
SHIPPED = [*MODELS, ROOT / "lorarl/assets/tokenizer"]
TEXTS = ["7*6=", " 12 + 30 = 42\n", "héllo wörld — ünïcode ✓ 数字", "<|im_start|>user\nhi<|im_end|>\n", "",
         "   leading and trailing spaces   ", "tab\tand\r\nnewlines\n\n", "<think>\n\n</think>\n\n", "a" * 300]
TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic (× ÷ — ✓).",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                        "required": ["expr"]}}}
CHATS = [
    [{"role": "user", "content": "5+5="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3="}],
    [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "again"}],
    [{"role": "user", "content": "what is 17*23?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
         "name": "calculator", "arguments": {"expr": "17*23"}}}]},
     {"role": "tool", "content": "391"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nanswer"}],
]


def hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def hf_ids(tok, chat, **kwargs) -> list[int]:
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)
    return [int(i) for i in ids]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_lean_tokenizer_gives_transformers_ids_and_text_on_each_shipped_model(path: Path) -> None:
    lean, full = LeanTokenizer.from_dir(path), hf(path)
    assert lean is not None and isinstance(load_tokenizer(path), LeanTokenizer)  # shipped models take the lean path
    assert lean.eos_token_id == full.eos_token_id
    assert (lean.chat_template is None) == (getattr(full, "chat_template", None) is None)
    for text in TEXTS:
        for special in (True, False):
            assert lean.encode(text, add_special_tokens=special) == full.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    vocab = full.vocab_size + len(full.added_tokens_decoder)
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] + [full.eos_token_id]
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip), ids
    if lean.chat_template is None:
        return
    for chat in CHATS:
        for generation in (True, False):
            for extra in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
                for tools in (None, [TOOL]):
                    args = dict(tools=tools, add_generation_prompt=generation, **extra)
                    assert lean.apply_chat_template(chat, **args) == hf_ids(full, chat, **args), (chat, args)
                    assert lean.apply_chat_template(chat, tokenize=False, **args) == \
                        full.apply_chat_template(chat, tokenize=False, **args)


def copy_of(tmp_path: Path, **config_changes) -> Path:
    target = tmp_path / f"tok{len(list(tmp_path.iterdir()))}"
    shutil.copytree(ROOT / "lorarl/assets/models/qwen3-tiny", target,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("change", [{"tokenizer_class": "Qwen2Tokenizer"}, {"add_bos_token": True},
                                    {"clean_up_tokenization_spaces": True}, {"chat_template": [{"name": "default",
                                                                                                "template": "x"}]},
                                    {"eos_token": "<|endoftext|>"}])
def test_files_the_lean_tokenizer_does_not_reproduce_go_to_transformers(tmp_path: Path, change: dict) -> None:
    """A class with Python-side behaviour, added BOS, space clean-up, named templates, or special tokens on which
    tokenizer_config.json and special_tokens_map.json disagree."""
    path = copy_of(tmp_path, **change)
    assert LeanTokenizer.from_dir(path) is None
    assert not isinstance(load_tokenizer(path), LeanTokenizer)


def test_a_template_file_beside_the_config_goes_to_transformers(tmp_path: Path) -> None:
    path = copy_of(tmp_path)
    (path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert LeanTokenizer.from_dir(path) is None
    assert LeanTokenizer.from_dir(tmp_path / "missing") is None


def test_the_lean_template_refuses_what_transformers_refuses(tmp_path: Path) -> None:
    lean = LeanTokenizer.from_dir(copy_of(tmp_path))
    with pytest.raises(ValueError, match="empty conversation"):
        lean.apply_chat_template([])
    bad = LeanTokenizer.from_dir(copy_of(tmp_path, chat_template="{{ raise_exception('no system role') }}"))
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        bad.apply_chat_template([{"role": "user", "content": "x"}])
