"""docs/job-file.md is the generated reference of every job-file key: it must match the config classes."""

from __future__ import annotations

import dataclasses

from lorarl.client.job import reference
from lorarl.client.job.config import JobFileConfig
from lorarl.common.config import describe_keys


def test_the_key_reference_page_is_what_the_config_classes_generate():
    assert reference.PAGE.read_text() == reference.render(), (
        "docs/job-file.md is stale: run `python -m lorarl.client.job.reference --write`")


def test_every_job_file_key_says_what_it_does():
    undocumented = [k.key for k in describe_keys(JobFileConfig) if not k.doc.strip()]
    assert not undocumented, f"give these settings a doc=...: {undocumented}"


def test_the_reference_lists_every_leaf_key_once_with_its_default():
    keys = describe_keys(JobFileConfig)
    names = [k.key for k in keys]
    assert len(names) == len(set(names))
    by_name = {k.key: k for k in keys}
    assert by_name["loop.steps"].default == JobFileConfig().loop.steps
    assert by_name["trainer.optimizer.learning_rate"].kind == "a number"
    assert "'async'" in by_name["loop.mode"].kind
    # A section is not a key of its own: its fields are.
    assert "trainer.lora" not in by_name and "trainer.lora.rank" in by_name
    sections = {f.name for f in dataclasses.fields(JobFileConfig) if dataclasses.is_dataclass(f.type) or
                f.name not in ("job_id",)}
    assert {name.split(".", 1)[0] for name in names} >= sections
