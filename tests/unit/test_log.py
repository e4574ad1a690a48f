"""Structured logs: JSON lines carry ts, level, service, msg and extra fields; text is readable."""

from __future__ import annotations

import io
import json
import logging

import pytest

from lorarl.common.log import configure_logging


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def test_json_lines(restore_root_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("trainer", level="info", fmt="json", stream=stream)
    logger = logging.getLogger("lorarl.trainer.test")
    logger.debug("hidden")
    logger.info("step %d done", 7, extra={"job_id": "j1", "loss": 0.25})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    first = lines[0]
    assert first["level"] == "info"
    assert first["service"] == "trainer"
    assert first["msg"] == "step 7 done"
    assert first["logger"] == "lorarl.trainer.test"
    assert first["job_id"] == "j1" and first["loss"] == 0.25
    assert first["ts"].endswith("Z")
    assert lines[1]["level"] == "error" and "RuntimeError: boom" in lines[1]["exc"]


def test_text_and_reconfiguration(restore_root_logging: None) -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("rollout", fmt="json", stream=first)
    configure_logging("rollout", level="debug", fmt="text", stream=second)
    logging.getLogger("x").debug("hello", extra={"port": 5})
    assert first.getvalue() == ""  # the earlier handler was replaced, not duplicated
    line = second.getvalue().strip()
    assert "DEBUG" in line and "rollout x: hello" in line and "port=5" in line


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError):
        configure_logging("x", fmt="xml")
