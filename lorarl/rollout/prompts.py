"""Text prompts to token ids (optionally with the model's chat template), and token ids back to text.

Uses the tokenizer shipped in the model directory, the same one vLLM and transformers load, so a
text prompt becomes the same ids whichever engine serves it. Loaded on first use.
"""

from __future__ import annotations

import json
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

from lorarl.common.errors import InvalidArgumentError


class PromptRenderer:
    def __init__(self, model_path: str | Path) -> None:
        self.model_path = str(model_path)
        self._lock = threading.Lock()

    @cached_property
    def tokenizer(self) -> Any:
        from lorarl.contract.tokenizer import load_tokenizer

        with self._lock:
            return load_tokenizer(self.model_path)

    def encode(self, text: str, *, chat: bool, field: str) -> list[int]:
        """Token ids of `text`; with `chat`, text is a user message or a JSON list of {role, content}."""
        if not chat:
            return list(self.tokenizer.encode(text, add_special_tokens=True))
        messages = _messages(text, field)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidArgumentError(f"{field}.apply_chat_template", "this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""


def _messages(text: str, field: str) -> list[dict[str, str]]:
    stripped = text.lstrip()
    if not stripped.startswith("["):
        return [{"role": "user", "content": text}]
    try:
        messages = json.loads(stripped)
    except json.JSONDecodeError:
        return [{"role": "user", "content": text}]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise InvalidArgumentError(f"{field}.text", "a JSON chat must be a list of {\"role\": ..., \"content\": ...}")
    return messages
