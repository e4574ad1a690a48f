"""The Tinker front's durable paths (lorarl/tinker/state.py): written whole and atomically, read back as they
were, and a file the front cannot read refused by name rather than replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorarl.tinker.service import Sampler, Saved
from lorarl.tinker.state import FrontState


def test_paths_come_back_as_they_were_written(tmp_path: Path) -> None:
    state = FrontState(tmp_path / "state" / "front.json")
    assert state.load(Saved, Sampler) == ({}, {}, set())  # no file yet: nothing saved
    saved = {"tinker://s:train:0/weights/a": Saved("ckpt/a", "export/a", "base", 8, {"rank": 8})}
    samplers = {"tinker://s:train:0/sampler_weights/v3": Sampler("base", "tinker-s-0", 3,
                                                                "tinker://s:train:0/sampler_weights/v3",
                                                                "export/sampler-v3", {"rank": 8})}
    state.write(saved, samplers, {"tinker://s:train:0/weights/gone"})
    assert state.load(Saved, Sampler) == (saved, samplers, {"tinker://s:train:0/weights/gone"})
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["front.json"]  # no temporary left behind
    FrontState(None).write(saved, samplers, set())  # memory only: writes nothing


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "cannot be read"),
    (json.dumps({"version": 99}), "not a Tinker front state of version 1"),
    (json.dumps({"version": 1, "saved": {"p": {"checkpoint": "c"}}}), r"saved\['p'\] must hold exactly"),
])
def test_a_file_the_front_cannot_read_is_refused_by_name(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "front.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        FrontState(path).load(Saved, Sampler)
    assert path.read_text() == text  # never replaced
