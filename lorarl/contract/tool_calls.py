"""Tool calls in a completion's text, in Qwen3's format: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.

What the model writes is kept as is in the session's tokens; only the OpenAI response splits it into
``content`` and ``tool_calls``. A block whose JSON does not parse, or names no function, stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN = "<tool_call>"


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content without the well-formed calls, the calls as OpenAI ``tool_calls``)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in TOOL_CALL.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _call(body: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not parsed["name"]:
        return None
    arguments = parsed.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
