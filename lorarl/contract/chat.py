"""Prompts and chat turns as token ids, with the model's own tokenizer and chat template.

Episodes build their sequences from token ids (lorarl.client.workflow.api.Episode) and the rollout's
OpenAI-compatible endpoint extends a session's exact tokens turn by turn (lorarl.rollout.openai): both
render here, from the tokenizer files of the model directory every process loads, so the same
conversation gives the same ids everywhere. Whether a prompt is a chat is decided by its type (a list of
messages) or by ``data.chat_template`` for a plain string, never by parsing text.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from functools import cached_property
from typing import Any

Messages = Sequence[dict[str, Any]]


class ChatRenderer:
    """The model's tokenizer and chat template, with the job's system prompt and thinking switch."""

    def __init__(self, model_path: str, *, chat_template: bool = True, system_prompt: str = "",
                 enable_thinking: bool | None = None) -> None:
        self.model_path, self.chat_template = model_path, chat_template
        self.system_prompt, self.enable_thinking = system_prompt, enable_thinking
        self._lock = threading.Lock()

    @cached_property
    def tokenizer(self) -> Any:
        """lorarl.contract.tokenizer's: without transformers where the model's files allow it."""
        from lorarl.contract.tokenizer import load_tokenizer

        with self._lock:
            return load_tokenizer(self.model_path)

    def prompt_ids(self, prompt: str | Messages) -> list[int]:
        """A data row's prompt: a list of messages is a chat; a string is a user turn with
        ``data.chat_template``, else plain text (with the tokenizer's own special tokens)."""
        if isinstance(prompt, str):
            return list(self._text_prompt_ids(prompt))
        return self._chat_prompt_ids(prompt)

    @functools.lru_cache(maxsize=65536)  # noqa: B019  (one renderer per job: a text prompt renders once)
    def _text_prompt_ids(self, prompt: str) -> tuple[int, ...]:
        return tuple(self._chat_prompt_ids(prompt))

    def _chat_prompt_ids(self, prompt: str | Messages) -> list[int]:
        if isinstance(prompt, str):
            if not self.chat_template:
                return [int(i) for i in self.tokenizer.encode(prompt, add_special_tokens=True)]
            prompt = [{"role": "user", "content": prompt}]
        messages = list(prompt)
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.render(messages)

    def render(self, messages: Messages, *, tools: Sequence[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer in {self.model_path} has no chat template")
        kwargs: dict[str, Any] = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        ids = self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                 add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def render_followup(self, messages: Messages, *, tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """What follows an assistant turn that ended with its end-of-turn token: the template's glue after
        that token (ChatML's newline), ``messages``, then the next assistant turn's opening. Found in a
        rendering of a short conversation followed by ``messages``: what comes after the head's last
        end-of-turn token. (Not as the difference of two renderings: Qwen3's thinking template writes an
        empty think block into the last assistant turn only, so a shorter rendering is no prefix.)"""
        head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = self.render(head, tools=tools, add_generation_prompt=False)
        after = self.render([*head, *messages], tools=tools, add_generation_prompt=True)
        end = self.end_of_turn_id
        ends = [i for i, token in enumerate(after) if token == end]
        count = before.count(end)
        if count == 0 or len(ends) < count:
            raise ValueError("the chat template ends no assistant turn with the tokenizer's EOS token; render the "
                             "whole conversation with ctx.render instead")
        return after[ends[count - 1] + 1:]

    @property
    def end_of_turn_id(self) -> int:
        """The token an assistant turn ends with (the tokenizer's EOS: <|im_end|> for Qwen3)."""
        return int(self.tokenizer.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True) if token_ids else ""
