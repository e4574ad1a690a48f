"""The model's tokenizer, loaded where every process renders prompts and counts tokens (lorarl.contract.chat).

A model directory whose tokenizer is a plain fast tokenizer (`tokenizer.json`, class `PreTrainedTokenizerFast`,
no added BOS/EOS, no clean-up of spaces, one chat template) is served by `tokenizers` and jinja2 directly: the
same ids and text as transformers' AutoTokenizer (tests/unit/test_tokenizer.py holds the two together
on every shipped model). Any other directory gets AutoTokenizer itself.

Hand-written for start-up time: loading a tokenizer through transformers 5 imports torch, torch.distributed's
tensor package, dynamo, scipy and scikit-learn, ~6 CPU-seconds that every `lorarl run`, `lorarl train` and SDK
client paid before its first prompt (and the test suite once per run, #29). The chat-template environment below
is transformers' own (`transformers.utils.chat_template_utils._compile_jinja_template`, Apache-2.0): a
sandbox with trim_blocks and lstrip_blocks, loop controls, its `tojson`, `raise_exception` and `strftime_now`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

#: The named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: The tokenizer classes whose files say all there is to them: nothing in Python changes what tokenizer.json does.
LEAN_CLASSES = ("PreTrainedTokenizerFast",)


def load_tokenizer(model_path: str | Path) -> Any:
    """The lean tokenizer where the directory's files allow it (see the module's docstring), else AutoTokenizer."""
    lean = LeanTokenizer.from_dir(Path(model_path))
    if lean is not None:
        return lean
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def import_in_advance(model_path: str | Path) -> None:
    """Imports transformers' tokenizer classes where load_tokenizer will need them (a caller runs this in the
    background while other work goes on); reads only the small config files, never tokenizer.json."""
    if _lean_settings(Path(model_path)) is None:
        from transformers import AutoTokenizer  # noqa: F401


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class LeanTokenizer:
    """encode, decode, eos_token_id, chat_template and apply_chat_template as transformers' fast tokenizer has
    them, for the files `from_dir` accepts."""

    def __init__(self, tokenizer: Any, special: dict[str, str], chat_template: str | None) -> None:
        self._tokenizer = tokenizer
        self.special_tokens_map = special
        self.chat_template = chat_template
        eos = special.get("eos_token")
        self.eos_token_id = tokenizer.token_to_id(eos) if eos is not None else None

    @classmethod
    def from_dir(cls, path: Path) -> LeanTokenizer | None:
        """None where the files ask for anything the lean path does not reproduce."""
        settings = _lean_settings(path)
        if settings is None:
            return None
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), *settings)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Sequence[dict[str, Any]], tools: Sequence[dict] | None = None,
                            documents: Sequence[dict] | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False, **kwargs: Any) -> list[int] | str:
        """One conversation, rendered as transformers renders it; ids (never a dict) or, without tokenize, text."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        text = _compiled(self.chat_template).render(
            messages=list(conversation), tools=list(tools) if tools is not None else None, documents=documents,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _lean_settings(path: Path) -> tuple[dict[str, str], str | None] | None:
    """The special tokens and chat template of a directory the lean path reproduces; None for any other."""
    files = path / "tokenizer.json", path / "tokenizer_config.json"
    if not all(f.is_file() for f in files):
        return None
    try:
        config = json.loads(files[1].read_text())
        mapped = json.loads((path / "special_tokens_map.json").read_text()) \
            if (path / "special_tokens_map.json").is_file() else {}
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not isinstance(mapped, dict):
        return None
    if config.get("tokenizer_class") not in LEAN_CLASSES or config.get("add_bos_token") or \
            config.get("add_eos_token") or config.get("clean_up_tokenization_spaces"):
        return None
    special = {}
    for name in SPECIAL_TOKENS:
        value, other = _token_text(config.get(name)), _token_text(mapped.get(name))
        if name in mapped and other != value:
            return None  # the two files disagree: transformers' merge decides, not a guess here
        if value is not None:
            special[name] = value
    template = config.get("chat_template")
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return None
    if template is not None and not isinstance(template, str):
        return None  # named templates: transformers chooses among them
    return special, template


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks assistant spans with it;
        rendering needs only the text)."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
