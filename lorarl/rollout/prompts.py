"""Text prompts to token ids (optionally with the model's chat template), and token ids back to text.

The rollout's view of lorarl.contract.chat.ChatRenderer (the one tokenizer loader and chat rendering every
service shares, so a text prompt becomes the same ids whichever engine serves it): here a failure names the
request field it came from. Loaded on first use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorarl.common.errors import InvalidArgumentError
from lorarl.contract.chat import ChatRenderer


class PromptRenderer:
    def __init__(self, model_path: str | Path) -> None:
        self.chat = ChatRenderer(str(model_path))

    @property
    def tokenizer(self) -> Any:
        return self.chat.tokenizer

    def encode(self, text: str, *, chat: bool, field: str) -> list[int]:
        """Token ids of `text`; with `chat`, text is a user message or a JSON list of {role, content}."""
        if not chat:
            return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=True)]
        messages = _messages(text, field)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidArgumentError(f"{field}.apply_chat_template", "this model's tokenizer has no chat template")
        return self.chat.render(messages)

    def decode(self, token_ids: list[int]) -> str:
        return self.chat.decode(token_ids)


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
