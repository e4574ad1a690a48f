"""The project's tokenizer: byte-level, no merges, Qwen-style chat markers, built locally.

Byte-level means any text encodes (no unknown tokens) and decodes the way Qwen's tokenizer does, so
vLLM's incremental detokenizer handles it like a real model's. Without merges every byte is one
token: ids 0-255 *are* the byte values, which keeps the vocabulary (264) and the tiny models small
and makes token ids readable in tests. The chat roles are whole-word tokens, as in Qwen's vocabulary,
so a chat-formatted task prompt is about 20 tokens. The chat template is a Qwen-style ChatML template stored in
``tokenizer_config.json``, so transformers' ``apply_chat_template`` and vLLM's chat handling render
prompts identically.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from lorarl.assets.paths import TOKENIZER_DIR

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
ROLE_TOKENS = ("system", "user", "assistant")
"""Whole-word tokens (not special), as in Qwen's vocabulary: chat headers cost one token each."""
RESERVED_TOKENS = tuple(f"<|reserved_{i}|>" for i in range(2))
"""Unused specials that round the vocabulary up to a multiple of 8."""
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
ADDED_TOKENS = (*SPECIAL_TOKENS, *ROLE_TOKENS, *RESERVED_TOKENS)
"""Ids 256.. in this order."""

VOCAB_SIZE = 256 + len(ADDED_TOKENS)
PAD_TOKEN_ID = 256
IM_START_ID = 257
EOS_TOKEN_ID = 258
MODEL_MAX_LENGTH = 2048

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool.function if tool.function is defined else tool) | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- ('\\n' if message.content or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + fn.name"
    " + '\", \"arguments\": ' + (fn.arguments if fn.arguments is string else fn.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as in Qwen's templates, without default system prompt or thinking block; tools, tool calls and
tool responses in Qwen3's format (<tools>, <tool_call>{"name", "arguments"}</tool_call>, <tool_response>),
with a shorter tool header than Qwen3's: the tools' JSON only, no instructions (byte-level tokens make every
character one token)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which ByteLevel pre-tokenization uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def build_tokenizer() -> Tokenizer:
    """The raw ``tokenizers`` object: 256 byte tokens (id == byte value) plus the special tokens."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([_added_token(t) for t in ADDED_TOKENS])
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID and tokenizer.token_to_id(PAD_TOKEN) == PAD_TOKEN_ID
    return tokenizer


def _is_special(token: str) -> bool:
    return token not in ROLE_TOKENS


def _added_token(token: str) -> AddedToken:
    return AddedToken(token, special=_is_special(token), normalized=False)


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: the class to load, the special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(256 + i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": _is_special(token),
            }
            for i, token in enumerate(ADDED_TOKENS)
        },
    }


def save_tokenizer(out_dir: Path = TOKENIZER_DIR) -> Path:
    """Write the tokenizer files into ``out_dir`` (a tokenizer dir or a model dir)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    _write_json(out_dir / "special_tokens_map.json", {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN})
    return out_dir


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(path: Path | str = TOKENIZER_DIR) -> Any:
    """The tokenizer as transformers loads it (``AutoTokenizer``), from a tokenizer or model dir."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@cache
def _cached_tokenizer(path: str) -> Any:
    return load_tokenizer(path)


def render_prompt(tokenizer: Any, prompt: str) -> str:
    """The chat-formatted text a policy sees for a task prompt: one user turn plus the open
    assistant turn (``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``)."""
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of :func:`render_prompt` (no BOS: the template carries all markers)."""
    return list(tokenizer.encode(render_prompt(tokenizer, prompt), add_special_tokens=False))


def default_tokenizer() -> Any:
    """The shipped tokenizer, loaded once per process."""
    return _cached_tokenizer(str(TOKENIZER_DIR))
